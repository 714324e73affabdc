"""`tfprofd demo` end to end, and its Ctrl-C cleanup."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import proc_state, wait_for

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
    return proc_state(Path(f"/proc/{pid}/stat")) not in (None, "Z")


def finds_the_input_bottleneck(tmp_path) -> str:
    # The demo's own timeout (300 s) bounds the wait: the job trains 12 s as the agent sees it, whatever its start
    proc = demo(tmp_path, "--slow-after", "12")
    out, _ = proc.communicate(timeout=420)
    assert proc.returncode == 0, out[-3000:]
    assert "throughput_drop FIRING" in out
    assert "injected: the job's reads now take 2 ms per record" in out
    counted = out.rsplit("injected: ", 1)[1]  # what the demo found after its injection
    assert "bottleneck: input" in counted, out[-3000:]
    assert f"open in the viewer: xprof --logdir {tmp_path}/state/captures/" in counted
    assert "host over the" in counted  # the capture's host context
    return out


def test_demo_finds_the_input_bottleneck(tmp_path):
    finds_the_input_bottleneck(tmp_path)


def test_demo_finds_the_input_bottleneck_beside_a_cpu_hog(tmp_path):
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        finds_the_input_bottleneck(tmp_path)
    finally:
        hog.kill()
        hog.wait()


def test_demo_fails_when_the_capture_names_another_cause():
    from tfprofd.daemon.demo import check

    record = {"id": "20260101T000000Z-abcdef", "trigger": "rule", "rule": "throughput_drop", "status": "done",
              "analysis": {"bottleneck": "host_contention", "summary": "host_contention: other processes used 1.7 of "
                           "2 CPUs", "recommendation": "move them", "trace": "/x/plugins/profile/r/h.xplane.pb"}}
    ok, text = check(record)
    assert not ok
    assert "names host_contention, but the demo injected an input bottleneck" in text
    record["analysis"]["bottleneck"] = "input"
    assert check(record)[0]
    ok, text = check({**record, "status": "analysis_failed", "analysis": None, "reason": "analysis_error",
                      "detail": "boom"})
    assert not ok and "no analysis: analysis_error: boom" in text


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
