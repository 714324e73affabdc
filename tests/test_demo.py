"""`tfprofd demo` end to end, and its Ctrl-C cleanup."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import wait_for

pytestmark = pytest.mark.tf


def demo(tmp_path, *args: str, sigint_ignored: bool = False) -> subprocess.Popen:
    """The demo; ``sigint_ignored`` starts it as a shell's background job (``make test &``) would."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    return subprocess.Popen([sys.executable, "-m", "tfprofd.daemon", "demo", "--dir", str(tmp_path), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ignore)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"


def test_demo_finds_the_input_bottleneck(tmp_path):
    proc = demo(tmp_path, "--slow-after", "12")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "throughput_drop FIRING" in out
    assert "bottleneck: input" in out
    assert f"open in the viewer: xprof --logdir {tmp_path}/state/captures/" in out


def test_ctrl_c_stops_every_process_the_demo_started(tmp_path):
    proc = demo(tmp_path, sigint_ignored=True)
    first = proc.stdout.readline()
    pids = [int(p) for p in re.findall(r"pid (\d+)", first)]
    assert len(pids) == 2, first
    wait_for(lambda: all(alive(p) for p in pids), 10, message="agent and job running")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, out
    assert "interrupted: stopping the agent and the job" in out
    wait_for(lambda: not any(alive(p) for p in pids), 10, message="no process left behind")
