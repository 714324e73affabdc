"""Issue 4: detection latency (simulated GPU drop -> capture request, rule with for: 10s, 1 s interval)
and trigger latency (POST /api/v1/captures -> profiler session started inside the training process, read
from TensorFlow's own log line), measured against the real agent.

Targets: detection within 10 s + one sampling interval; trigger under 0.5 s.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tfprofd.exporter.hook import Reporter

from common import free_port, wait_http
from helpers import GpuState, build_fakenvml, gpu

QUICK = "--quick" in sys.argv  # one trial of each, a 2 s rule: the bench runs, no target means anything
INTERVAL = 1.0
FOR = 2.0 if QUICK else 10.0
TRIALS = 1 if QUICK else 4
TOKENS: dict[int, str] = {}  # API port -> the control API token its agent wrote
RULES = f"""
rules:
  - name: low_gpu_utilization
    description: shipped rule with for 10s
    signal: gpu_utilization
    below: 0.5
    for: {FOR}s
    cooldown: 0s
"""


def api(port: int, method: str, path: str, body: dict | None = None) -> dict:
    """A control API request with the token of the agent listening on ``port``."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1{path}", data=data, method=method,
                                 headers={"Authorization": f"Bearer {TOKENS[port]}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def start_agent(tmp: Path, state: GpuState) -> tuple[subprocess.Popen, int, int, int]:
    config = tmp / "tfprofd.yaml"
    config.write_text(RULES)
    port, api_port, hook_port = free_port(), free_port(), free_port(socket.SOCK_DGRAM)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfprofd.daemon", "run", "--config", str(config), "--listen", f"127.0.0.1:{port}",
         "--api.listen", f"127.0.0.1:{api_port}", "--hook.listen", f"127.0.0.1:{hook_port}",
         "--hook.socket", str(tmp / "hook.sock"),  # not the host's default socket another agent may hold
         "--state-dir", str(tmp / "state"), "--interval", f"{INTERVAL}s", "--captures.max-per-hour", "1000",
         "--captures.duration", "500ms"],
        env={**os.environ, **state.env()}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/healthz")
    TOKENS[api_port] = (tmp / "state" / "api.token").read_text().strip()  # written before the agent serves
    return proc, port, api_port, hook_port


def detection(tmp: Path) -> list[float]:
    build_fakenvml()
    state = GpuState(tmp / "nvml.json", [gpu(0, processes=[{"pid": os.getpid(), "used_memory_bytes": 1}])])
    agent, port, api_port, hook_port = start_agent(tmp, state)
    # This process plays the training job (reports steps, lists its pid on GPU 0); its port listens while
    # the agent checks that it is the job's own, then closes, so each capture fails fast with no_server,
    # but its request time is what we measure.
    reporter = Reporter(job="detect", profiler=False, addr=f"127.0.0.1:{hook_port}", interval=0.5)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        reporter.profiler_address = f"127.0.0.1:{server.getsockname()[1]}"
        reporter.phase = "train"
        reporter.record(1, 32, 0.01)
        reporter.start()
        while f'profiler_address="{reporter.profiler_address}"' not in urllib.request.urlopen(
                f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode():
            time.sleep(0.1)
    latencies = []
    try:
        for _ in range(TRIALS):
            time.sleep(3 + random.random() * INTERVAL)  # drop at a random phase of the sampling loop
            seen = {c["id"] for c in api(api_port, "GET", "/captures")["captures"]}
            dropped = time.time()
            state.update_gpu(0, utilization_gpu=20)
            while True:
                new = [c for c in api(api_port, "GET", "/captures")["captures"] if c["id"] not in seen]
                if new:
                    latencies.append(new[0]["requested_at"] - dropped)
                    break
                if time.time() - dropped > FOR + 10:
                    raise RuntimeError("the rule did not fire")
                time.sleep(0.05)
            state.update_gpu(0, utilization_gpu=95)
    finally:
        reporter.close()
        agent.terminate()
        agent.wait()
    return latencies


SESSION_LINE = re.compile(r"^I\d{4} \d\d:\d\d:(\d+\.\d+) .*Profiler session (started|initializing)")


def trigger(tmp: Path) -> list[float]:
    build_fakenvml()
    state = GpuState(tmp / "nvml2.json", [gpu(0)])
    (tmp / "t2").mkdir()
    agent, port, api_port, hook_port = start_agent(tmp / "t2", state)
    log_path = tmp / "train.log"
    env = {**os.environ, "TFPROFD_ADDR": f"127.0.0.1:{hook_port}", "TF_CPP_MIN_LOG_LEVEL": "0"}
    with open(log_path, "w") as log:
        job = subprocess.Popen([sys.executable, "-m", "tfprofd.daemon.demo_job", "--job", "trig", "--seconds", "120"],
                               env=env, stdout=subprocess.DEVNULL, stderr=log)
    latencies = []
    try:
        deadline = time.time() + 90
        while b'training_job="trig"' not in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read():
            if time.time() > deadline:
                raise RuntimeError("the job did not report")
            time.sleep(0.2)
        for _ in range(TRIALS):
            before = log_path.read_text().count("Profiler session started")
            posted = time.time()
            capture = api(api_port, "POST", "/captures", {"job": "trig", "duration_ms": 500})
            while log_path.read_text().count("Profiler session started") == before:
                time.sleep(0.02)
            line = [ln for ln in log_path.read_text().splitlines() if "Profiler session started" in ln][-1]
            started = float(SESSION_LINE.match(line).group(1))  # TF logs Unix seconds in this field
            latencies.append(started - posted)
            while api(api_port, "GET", f"/captures/{capture['id']}")["status"] == "running":
                time.sleep(0.1)
    finally:
        job.kill()
        agent.terminate()
        agent.wait()
    return latencies


def main() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        detect = detection(Path(tmp))
        trig = trigger(Path(tmp))
    r = {"detect_mean_s": statistics.fmean(detect), "detect_max_s": max(detect),
         "trigger_mean_s": statistics.fmean(trig), "trigger_max_s": max(trig)}
    print(f"detection latency, rule for: {FOR:g}s, interval {INTERVAL:g}s, {TRIALS} drops: "
          f"mean {r['detect_mean_s']:.2f} s, max {r['detect_max_s']:.2f} s  (target <= {FOR + INTERVAL:g} s)")
    print(f"trigger latency, POST -> 'Profiler session started' in the job, {TRIALS} captures: "
          f"mean {r['trigger_mean_s'] * 1000:.0f} ms, max {r['trigger_max_s'] * 1000:.0f} ms  (target < 500 ms)")
    return r


if __name__ == "__main__":
    main()
