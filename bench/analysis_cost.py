"""What analysing a capture costs: the analysis worker's wall time and peak memory on a 2 s capture and on a
capture ten times longer (20 s, about ten times the trace), and the agent's own RSS while it runs.

A real agent and the Keras demo job (with the hook); captures through the control API in the default
agent mode; the analysis worker is the agent's child process, watched from /proc every 50 ms. ``--quick``: one
0.5 s capture (CI: the bench runs; at 44c607f the 20 s capture ends analysis_failed on the 180 s timeout).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import psutil

from common import rss_bytes
from helpers import AgentProcess, job_reporting, start_training, wait_for


def measure(agent: AgentProcess, duration_ms: int) -> dict[str, float]:
    status, answer = agent.call("POST", "/captures", {"job": "cost", "duration_ms": duration_ms})
    assert status == 202, answer
    capture_id = answer["id"]
    parent = psutil.Process(agent.proc.pid)
    agent_rss = rss_bytes(agent.proc.pid)
    agent_max = agent_rss
    worker_peak = 0
    analyzing_since = done_at = None
    while True:
        record = agent.call("GET", f"/captures/{capture_id}")[1]
        now = time.monotonic()
        if record["status"] == "analyzing" and analyzing_since is None:
            analyzing_since = now
        if record["status"] not in ("running", "analyzing"):
            done_at = now
            break
        if record["status"] == "analyzing":
            agent_max = max(agent_max, rss_bytes(agent.proc.pid))
            for child in parent.children(recursive=True):
                try:
                    worker_peak = max(worker_peak, child.memory_info().rss)
                except psutil.Error:
                    pass
        time.sleep(0.05)
    assert record["status"] == "done", record
    return {"trace_mb": record["bytes"] / 1e6, "analysis_s": done_at - (analyzing_since or done_at),
            "worker_peak_mb": worker_peak / 1e6, "agent_before_mb": agent_rss / 1e6, "agent_max_mb": agent_max / 1e6,
            "steps": record["analysis"].get("steps", 0)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(Path(tmp), args=["--captures.baseline", "false", "--captures.max-per-hour", "100"],
                             fixtures=False).start()
        job = start_training(agent.hook_port, "--job", "cost", "--seconds", "400")
        try:
            wait_for(lambda: job_reporting(agent, "cost"), 120, message="the job to report")
            time.sleep(5)  # past the first epoch's tracing
            for duration_ms in (500,) if "--quick" in sys.argv else (2000, 20000):
                m = measure(agent, duration_ms)
                print(f"{duration_ms / 1000:g} s capture: trace {m['trace_mb']:.1f} MB, {m['steps']:.0f} steps; "
                      f"analysis {m['analysis_s']:.1f} s, worker peak RSS {m['worker_peak_mb']:.0f} MB; agent RSS "
                      f"{m['agent_before_mb']:.1f} MB before, at most {m['agent_max_mb']:.1f} MB during", flush=True)
        finally:
            job.kill()
            job.wait()
            agent.stop()


if __name__ == "__main__":
    main()
