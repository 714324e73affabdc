"""The seed guide's case studies, scaled to a CPU: each a Keras job with one slowdown, captured and analysed
by a real agent. Used by tests/test_scenarios.py (short) and bench/scenarios.py (the README table)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from helpers import AgentProcess, job_reporting, metric_value, start_training, wait_capture, wait_for

BASE = ["--features", "64", "--width", "1536", "--batch-size", "64", "--samples", "4096", "--map-delay", "0.0002",
        "--parallel-reads", "4"]


@dataclass(frozen=True)
class Scenario:
    name: str
    seed_case: str
    args: tuple[str, ...]
    expected: str


SCENARIOS = (
    Scenario("baseline", "baseline: CPU and GPU work in parallel", (), "device"),
    Scenario("input_bottleneck", "network input bottleneck: keep 1 of every 10 records",
             ("--keep-every", "10"), "input"),
    Scenario("heavy_preprocessing", "overloaded preprocessing: a heavy op in map", ("--heavy-map", "160"), "input"),
    Scenario("post_processing", "heavy post-processing in a callback", ("--post-ms", "40"), "host"),
    Scenario("small_batch", "small batch: batch size 2", ("--batch-size", "2"), "small_batch"),
    Scenario("small_batch_narrow", "small batch: batch size 2", ("--batch-size", "2", "--width", "256"), "small_batch"),
    Scenario("batch1", "small batch: batch size 1", ("--batch-size", "1"), "small_batch"),
)


def run(agent: AgentProcess, scenario: Scenario, warmup: float = 4.0) -> dict:
    """Train the scenario, measure samples/s, capture and analyse; returns the figures and the analysis."""
    job = start_training(agent.hook_port, "--job", scenario.name, "--seconds", str(warmup + 30), *BASE,
                         *scenario.args)
    try:
        wait_for(lambda: job_reporting(agent, scenario.name), 120, message=f"{scenario.name} to report")
        time.sleep(warmup)

        def samples() -> float:
            return metric_value(agent.scrape(), "tfprofd_training_samples_total", training_job=scenario.name) or 0

        first, started = samples(), time.monotonic()
        status, answer = agent.call("POST", "/captures", {"job": scenario.name, "duration_ms": 2000})
        assert status == 202, answer
        record = wait_capture(agent, answer["id"], timeout=240)
        rate = (samples() - first) / (time.monotonic() - started)
    finally:
        job.kill()
        job.wait()
    analysis = record.get("analysis") or {}
    return {"scenario": scenario.name, "expected": scenario.expected, "status": record["status"],
            "bottleneck": analysis.get("bottleneck"), "input_bound_ratio": analysis.get("input_bound_ratio"),
            "step_ms": (analysis.get("step_time_ms") or {}).get("mean"), "samples_per_second": rate,
            "summary": analysis.get("summary") or record.get("detail")}
