"""``tfprofd demo``: the whole loop in about a minute on a laptop CPU, no GPU needed.

Starts an agent and a small Keras job with the hook, turns an input bottleneck on midway, lets the
throughput-drop rule fire, captures, analyses, and prints what it found. Ctrl-C stops every process it
started.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

DEMO_RULES = """
rules:
  - name: throughput_drop
    description: samples/s under 70% of the job's recent median (demo timing; the shipped rule uses 10 minutes)
    signal: samples_per_second
    aggregate: mean
    window: 8s
    below_baseline: 0.7
    baseline: 2m
    for: 4s
    cooldown: 10m
"""


def _free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, token: str = "") -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read()


def _metric(text: str, name: str, needle: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and needle in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tfprofd demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow-after", type=float, default=25.0, help="seconds until the input bottleneck starts")
    parser.add_argument("--dir", type=Path, help="keep the agent's state (captures) here instead of a temp dir")
    parser.add_argument("--timeout", type=float, default=240.0, help="give up after this many seconds")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("tensorflow") is None:
        print("tfprofd demo: the demo trains a small Keras model and needs TensorFlow: pip install 'tfprofd[tf]'",
              file=sys.stderr)
        return 2
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="tfprofd-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tfprofd.yaml").write_text(DEMO_RULES)
    port, api_port, hook_port = _free_port(), _free_port(), _free_port(socket.SOCK_DGRAM)
    processes: list[subprocess.Popen] = []

    def cleanup(*_: Any) -> None:
        for proc in processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in processes:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()

    # Explicit handlers: a demo started from a non-interactive shell inherits SIGINT ignored.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log = open(workdir / "agent.log", "ab")
    try:
        agent = subprocess.Popen(
            [sys.executable, "-m", "tfprofd.daemon", "run", "--config", str(workdir / "tfprofd.yaml"),
             "--listen", f"127.0.0.1:{port}", "--api.listen", f"127.0.0.1:{api_port}",
             "--hook.listen", f"127.0.0.1:{hook_port}", "--hook.socket", str(workdir / "hook.sock"),
             "--state-dir", str(workdir / "state"),
             "--collectors.nvml.enabled", "false"],
            stdout=log, stderr=subprocess.STDOUT)
        processes.append(agent)
        env = {**os.environ, "TFPROFD_ADDR": f"127.0.0.1:{hook_port}", "TF_CPP_MIN_LOG_LEVEL": "3"}
        job = subprocess.Popen(
            [sys.executable, "-m", "tfprofd.daemon.demo_job", "--job", "demo", "--seconds", str(args.timeout),
             "--features", "64", "--width", "1024", "--batch-size", "64", "--samples", "4096",
             "--map-delay", "0.002", "--parallel-reads", "4", "--slow-after", str(args.slow_after + 5)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(workdir / "job.log", "ab"))
        processes.append(job)
        print(f"tfprofd demo in {workdir}: agent pid {agent.pid} (metrics http://127.0.0.1:{port}/metrics), "
              f"Keras job pid {job.pid}", flush=True)
        print(f"the job's input pipeline slows down ~{args.slow_after:.0f}s after it starts training; "
              "watch the throughput-drop rule fire", flush=True)
        return _watch(port, api_port, workdir / "state" / "api.token", args.timeout, processes)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the agent and the job", flush=True)
        return 130
    finally:
        cleanup()
        log.close()


def _watch(port: int, api_port: int, token_file: Path, timeout: float, processes: list[subprocess.Popen]) -> int:
    from .analysis import CaptureAnalysis, report

    started = time.monotonic()
    while time.monotonic() - started < timeout:
        time.sleep(1)
        for proc in processes:
            if proc.poll() is not None:
                print(f"tfprofd demo: process {proc.pid} exited early ({proc.returncode}); see the logs",
                      file=sys.stderr)
                return 1
        try:
            text = _get(f"http://127.0.0.1:{port}/metrics").decode()
            token = token_file.read_text().strip()
            captures = json.loads(_get(f"http://127.0.0.1:{api_port}/api/v1/captures", token))["captures"]
        except OSError:
            continue
        rate = _metric(text, "tfprofd_training_samples_per_second", 'training_job="demo"')
        firing = _metric(text, "tfprofd_rule_active", 'rule="throughput_drop"')
        state = captures[0]["status"] if captures else "none yet"
        shown = "-" if rate is None else f"{rate:.0f}"
        print(f"  t={time.monotonic() - started:5.0f}s  samples/s {shown:>6}  "
              f"throughput_drop {'FIRING' if firing else 'quiet':6}  capture: {state}", flush=True)
        if captures and captures[0]["status"] not in ("running", "analyzing"):
            record = captures[0]
            print(f"\ncapture {record['id']} ({record['trigger']}, rule {record['rule']}): {record['status']}")
            if record.get("analysis"):
                print(report(CaptureAnalysis.from_json(record["analysis"])))
                return 0
            print(f"no analysis: {record.get('reason')}: {record.get('detail')}")
            return 1
    print("tfprofd demo: no capture within the time limit", file=sys.stderr)
    return 1
