"""The seed guide's case studies, scaled to a CPU: each a Keras job with one slowdown, and the same job
healthy (its baseline), captured and analysed by a real agent. Used by tests/test_scenarios.py (short)
and bench/scenarios.py (the README table)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from helpers import AgentProcess, job_reporting, metric_value, start_training, wait_capture, wait_for

BASE = ("--features", "64", "--width", "1536", "--batch-size", "64", "--samples", "4096", "--map-delay", "0.0002",
        "--parallel-reads", "4")
# A small model with no read cost: its steps are short, so the batch decides whether compute or the fixed
# per-step overhead fills them.
SMALL_MODEL = ("--features", "64", "--width", "256", "--samples", "4096", "--map-delay", "0")


@dataclass(frozen=True)
class Scenario:
    name: str
    seed_case: str
    args: tuple[str, ...]  # the slowed job
    expected: str  # what tfprofd must name
    healthy: tuple[str, ...] = BASE  # the same job running well: its baseline
    grew: str | None = None  # the step part that grows from baseline to incident, if one does


SCENARIOS = (
    Scenario("baseline", "baseline: CPU and GPU work in parallel", BASE, "device"),
    Scenario("input_bottleneck", "network input bottleneck: keep 1 of every 10 records",
             (*BASE, "--keep-every", "10"), "input", grew="input_wait"),
    Scenario("heavy_preprocessing", "overloaded preprocessing: a heavy op in map", (*BASE, "--heavy-map", "160"),
             "input", grew="input_wait"),
    Scenario("post_processing", "heavy post-processing in a callback", (*BASE, "--post-ms", "40"), "host"),
    Scenario("small_batch", "small batch: batch size 2", (*SMALL_MODEL, "--batch-size", "2"), "small_batch",
             healthy=(*SMALL_MODEL, "--batch-size", "512")),
)
# Held out: a pause between short steps, in a trace made without tfprofd. Time between steps, not batch size.
PAUSE = Scenario("pause_between_steps", "post-processing outside the traced step",
                 (*SMALL_MODEL, "--batch-size", "64", "--pause-ms", "5"), "host")


def capture(agent: AgentProcess, job: str, args: tuple[str, ...], warmup: float = 4.0) -> tuple[dict, float]:
    """Train a job, capture 2 s of it through the agent; (its record, samples/s during the capture)."""
    proc = start_training(agent.hook_port, "--job", job, "--seconds", str(warmup + 40), *args)
    try:
        wait_for(lambda: job_reporting(agent, job), 120, message=f"{job} to report")
        time.sleep(warmup)

        def samples() -> float:
            return metric_value(agent.scrape(), "tfprofd_training_samples_total", training_job=job) or 0

        first, started = samples(), time.monotonic()
        status, answer = agent.call("POST", "/captures", {"job": job, "duration_ms": 2000})
        assert status == 202, answer
        record = wait_capture(agent, answer["id"], timeout=240)
        rate = (samples() - first) / (time.monotonic() - started)
    finally:
        proc.kill()
        proc.wait()
    return record, rate


def run(agent: AgentProcess, scenario: Scenario, warmup: float = 4.0) -> dict:
    """Capture the scenario's slowed job; its figures and the analysis."""
    record, rate = capture(agent, scenario.name, scenario.args, warmup)
    analysis = record.get("analysis") or {}
    return {"scenario": scenario.name, "expected": scenario.expected, "status": record["status"],
            "bottleneck": analysis.get("bottleneck"), "input_bound_ratio": analysis.get("input_bound_ratio"),
            "step_ms": (analysis.get("step_time_ms") or {}).get("mean"), "samples_per_second": rate,
            "summary": analysis.get("summary") or record.get("detail"), "directory": record["directory"],
            "ops_busy": (analysis.get("ratios") or {}).get("ops_busy"),
            "between_steps": (analysis.get("ratios") or {}).get("between_steps")}


def plain_trace(tmp: Path, scenario: Scenario, seconds: float) -> Path:
    """A trace of the scenario made with TensorFlow's own profiler APIs in a custom loop: no hook, no agent."""
    logdir = tmp / f"plain-{scenario.name}"
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon.demo_job", *scenario.args, "--plain-profile",
                             str(logdir), "--profile-seconds", str(seconds)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["steps"] > 2, result.stdout
    return logdir
