"""``tfprofd demo``: the whole loop in about a minute on a laptop CPU, no GPU needed.

Starts an agent and a small Keras job with the hook, turns an input bottleneck on once the job has trained
steadily for a while, lets the throughput-drop rule fire, captures, analyses, prints what it found, and exits
non-zero unless that is the input bottleneck it injected. Ctrl-C stops every process it started.

On a busy machine the rule may fire before the injection, on a dip caused by other processes: such a capture
is shown but not counted, and the injection waits until it has finished and the rule is quiet again. A capture
that ends ``host_contention`` does not spend the rule's cooldown (see policy.py); one that names another cause
does, which is why the demo's rule cools down for 30 s only and the injection waits that long after it.
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
    cooldown: 30s
"""
COOLDOWN = 30.0  # the rule's cooldown above
INJECTED = "input"
WAIT_AT_MOST = 120.0  # past the steady period, inject even if the rule keeps firing on other processes' load


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
    parser.add_argument("--slow-after", type=float, default=25.0,
                        help="seconds of steady training (as the agent sees it) before the input bottleneck starts")
    parser.add_argument("--dir", type=Path, help="keep the agent's state (captures) here instead of a temp dir")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
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
            [sys.executable, "-m", "tfprofd.daemon.demo_job", "--job", "demo", "--seconds", str(args.timeout + 60),
             "--features", "64", "--width", "1024", "--batch-size", "64", "--samples", "4096",
             "--map-delay", "0.002", "--parallel-reads", "4", "--slow-on-signal"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(workdir / "job.log", "ab"))
        processes.append(job)
        print(f"tfprofd demo in {workdir}: agent pid {agent.pid} (metrics http://127.0.0.1:{port}/metrics), "
              f"Keras job pid {job.pid}", flush=True)
        print(f"the job's input pipeline slows down once it has trained steadily for {args.slow_after:.0f}s; "
              "watch the throughput-drop rule fire", flush=True)
        return _watch(port, api_port, workdir / "state" / "api.token", args.timeout, processes, job,
                      args.slow_after)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the agent and the job", flush=True)
        return 130
    finally:
        cleanup()
        log.close()


def check(record: dict[str, Any]) -> tuple[bool, str]:
    """Whether a finished capture found what the demo injected, and what to print about it."""
    from .analysis import CaptureAnalysis, report
    from .hostcontext import HostContext

    head = f"capture {record['id']} ({record['trigger']}, rule {record['rule']}): {record['status']}"
    host = "\n".join(HostContext.from_json(record["host"]).lines()) if record.get("host") else ""
    if not record.get("analysis"):
        return False, f"{head}\nno analysis: {record.get('reason')}: {record.get('detail')}"
    analysis = CaptureAnalysis.from_json(record["analysis"])
    text = "\n".join(t for t in (head, report(analysis), host) if t)
    if analysis.bottleneck != INJECTED:
        return False, (f"{text}\ntfprofd demo: the capture names {analysis.bottleneck}, but the demo injected "
                       f"an {INJECTED} bottleneck")
    return True, text


def _watch(port: int, api_port: int, token_file: Path, timeout: float, processes: list[subprocess.Popen],
           job: subprocess.Popen, steady: float) -> int:
    started = time.monotonic()
    training_since: float | None = None  # when the agent first saw the job's samples/s
    injected_at: float | None = None  # Unix time of the injection: captures asked for later count
    shown: set[str] = set()
    while time.monotonic() - started < timeout:
        time.sleep(1)
        for proc in processes:
            if proc.poll() is not None:
                print(f"tfprofd demo: process {proc.pid} exited early ({proc.returncode}); see the logs",
                      file=sys.stderr)
                return 1
        try:  # the captures first: one kept when the rule fired is then seen with the rule firing in /metrics
            token = token_file.read_text().strip()
            captures = json.loads(_get(f"http://127.0.0.1:{api_port}/api/v1/captures", token))["captures"]
            text = _get(f"http://127.0.0.1:{port}/metrics").decode()
        except OSError:
            continue
        now = time.monotonic()
        rate = _metric(text, "tfprofd_training_samples_per_second", 'training_job="demo"')
        firing = _metric(text, "tfprofd_rule_active", 'rule="throughput_drop"')
        if rate and training_since is None:
            training_since = now
        active = [c for c in captures if c["status"] in ("running", "analyzing")]
        state = captures[0]["status"] if captures else "none yet"
        print(f"  t={now - started:5.0f}s  samples/s {'-' if rate is None else f'{rate:.0f}':>6}  "
              f"throughput_drop {'FIRING' if firing else 'quiet':6}  capture: {state}"
              f"{'' if injected_at else '  (input still fast)'}", flush=True)
        for record in reversed(captures):  # oldest first
            if record["status"] in ("running", "analyzing") or record["id"] in shown:
                continue
            shown.add(record["id"])
            ok, report_text = check(record)
            if injected_at is None or record["requested_at"] < injected_at:
                print(f"\nbefore the injection (not counted):\n{report_text}\n", flush=True)
                continue
            print(f"\n{report_text}")
            return 0 if ok else 1
        if injected_at is None and training_since is not None and now - training_since >= steady \
                and _may_inject(captures, firing, active, now - training_since - steady):
            job.send_signal(signal.SIGUSR1)
            injected_at = time.time()
            print(f"  t={now - started:5.0f}s  injected: the job's reads now take 2 ms per record", flush=True)
    print("tfprofd demo: no capture within the time limit", file=sys.stderr)
    return 1


def _may_inject(captures: list[dict[str, Any]], firing: float | None, active: list[dict[str, Any]],
                waited: float) -> bool:
    """Inject when a capture of it can follow: the rule quiet, no capture running, the last one's cooldown over
    (or lifted: it found host contention). After WAIT_AT_MOST, inject anyway."""
    if waited >= WAIT_AT_MOST:
        return True
    if firing or active:
        return False
    last = captures[0] if captures else None
    return (last is None or (last.get("analysis") or {}).get("bottleneck") == "host_contention"
            or time.time() - last["requested_at"] >= COOLDOWN)
