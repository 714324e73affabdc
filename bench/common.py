"""Helpers shared by the benchmarks: processes, ports, percentiles, /proc readings."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import GpuState, build_fakenvml, free_port, hopper  # noqa: E402


def seasoned(reporter: object) -> None:
    """Put a day of training behind a hook's ``Reporter``: 4.3 million 20 ms steps and 20,000 of 0.3 s, so its
    counts are past a million as a long job's are. The agent writes those in Go's exponent form, which costs
    more than small counts: jobs that start from nothing made a bench measure less than a node pays."""
    reporter.record(4_300_000, 4_300_000 * 64, 4_300_000 * 0.02)  # type: ignore[attr-defined]
    reporter.record(20_000, 20_000 * 64, 20_000 * 0.3)  # type: ignore[attr-defined]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


def start_agent(tmp: Path, gpus: int, interval: str = "1s", extra: list[str] | None = None,
                env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    build_fakenvml()
    state = GpuState(tmp / "nvml.json", [hopper(i) for i in range(gpus)])  # every reading a Hopper has
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfprofd.daemon", "run", "--listen", f"127.0.0.1:{port}",
         "--api.listen", f"127.0.0.1:{free_port()}", "--hook.listen", f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}",
         "--hook.socket", str(tmp / "hook.sock"), "--state-dir", str(tmp / "state"), "--interval", interval,
         *(extra or [])],
        env={**os.environ, **state.env(), **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return serving(proc, port)


def start_node_exporter() -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(["prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return serving(proc, port)


def serving(proc: subprocess.Popen, port: int) -> tuple[subprocess.Popen, int]:
    """Wait until the process serves /metrics on the port; stop it (no stray process) if it never does."""
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics")
    except RuntimeError:
        stop(proc)
        raise
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
