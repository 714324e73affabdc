"""What continuous profiling armed by the agent costs the training it watches, side by side in one run.

The hook-overhead bench's small Keras model (under 1 ms per step on this CPU, where a per-op cost shows
most) trains with the default ``TfprofdCallback`` (profiler server, step markers) through the lines of
Keras 3's fit loop. Each round runs two phases of ``PHASE`` seconds in a new random order: **none**
(nothing armed) and **armed** (a capture worker, as the agent runs it, arms ``StartContinuousProfiling``
in this process and takes a snapshot every ``INTERVAL`` seconds into its ring, exactly as while a rule is
pending; the ring is dropped at the end of the phase). The worker starts and arms between phases, so a
phase times only training. Each round's armed rate over its none rate is one paired ratio.

A loaded machine's speed drifts over seconds (phases of 6 s, 5 to 8 rounds in one process, gave ratios
from 0.48 to 1.33), so, as in bench/hook_overhead.py: short phases, many rounds per process, fresh processes
one after another (``MIN_PROCESSES`` to ``MAX_PROCESSES``, ``SECONDS`` of rounds each), and a two-level
bootstrap 95% interval of the median ratio (processes, then rounds within each). More processes run until
the interval is narrower than the distance of the median from 1 (the effect is resolved) or within ±1%,
or the time budget (``BUDGET`` seconds in all) is spent; the output says which.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import tensorflow as tf
from hook_overhead import BATCH, Turn, begun, grouped_ci, make_model

from tfprofd.daemon.pending import RingWorker
from tfprofd.daemon.workers import WorkerPool
from tfprofd.exporter.hook import TfprofdCallback

from common import free_port

QUICK = "--quick" in sys.argv  # one short process: the bench runs, the figure means nothing
PHASE = 1.0 if QUICK else 4.0  # seconds per phase: two snapshots at the agent's default 2 s
INTERVAL = 0.5 if QUICK else 2.0  # captures.snapshot_interval's default
SECONDS = 3 if QUICK else 80  # of rounds per process
MIN_PROCESSES, MAX_PROCESSES = (1, 1) if QUICK else (4, 8)
BUDGET = 60 if QUICK else 13 * 60  # seconds for the whole run: no new process once it could overrun
PRECISE = 0.01  # an interval within ±1% is precise enough whatever the effect


def phase(turn: Turn, seconds: float) -> float:
    """Steps per second over ``seconds`` of training."""
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        steps += 25
        turn.run(25)
    return steps / (time.perf_counter() - started)


def worker() -> None:
    """One process's rounds, as JSON on the last line of stdout."""
    port = free_port()
    tf.profiler.experimental.server.start(port)
    model = make_model()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(1500, 32)).astype("float32"), rng.normal(size=(1500, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model.fit(dataset.take(20), epochs=1, verbose=0)  # trace the train function
    callbacks = begun(model, [TfprofdCallback(job="bench", profiler=False)])
    turn = Turn(callbacks, model.train_function, dataset)
    phase(turn, 0.5 if QUICK else 2.0)  # warm up: tracing, the first steps
    pool = WorkerPool("bench", limit=1)
    request = {"mode": "agent", "targets": [f"127.0.0.1:{port}"], "duration_ms": 1000, "max_trace_bytes": 256 << 20,
               "host_tracer_level": 2, "device_tracer_level": 1, "python_tracer_level": 0, "delay_ms": 0,
               "interval": INTERVAL, "keep": 8, "max_bytes": 64 << 20, "rpc_timeout": 30.0, "min_s": 0.0,
               "deadline_s": 3600}
    ratios, stop_ms, none_rates = [], [], []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as logdir:
        while time.monotonic() - started < SECONDS:
            rates = {}
            for variant in random.sample(["none", "armed"], 2):
                ring = None
                if variant == "armed":
                    ring = RingWorker(pool, {**request, "logdir": logdir}, 30)
                    armed = ring.answer(60)
                    assert armed.get("armed"), f"continuous profiling could not be armed: {armed}"
                rates[variant] = phase(turn, PHASE)
                if ring is not None:
                    t0 = time.perf_counter()
                    ring.finish("drop", 30)
                    stop_ms.append((time.perf_counter() - t0) * 1000)
            ratios.append(rates["armed"] / rates["none"])
            none_rates.append(rates["none"])
    print(json.dumps({"ratios": ratios, "stop_ms": stop_ms, "step_ms": 1000 / statistics.median(none_rates)}))


def settled(groups: list[list[float]]) -> bool:
    median, low, high = grouped_ci(groups)
    half = (high - low) / 2
    return half < PRECISE or half < abs(1 - median)


def main() -> dict[str, float]:
    runs: list[dict] = []
    began = time.monotonic()
    why = "the process limit"
    while len(runs) < MAX_PROCESSES:
        took = time.monotonic()
        out = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], capture_output=True, text=True,
                             check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        took = time.monotonic() - took
        ratios = runs[-1]["ratios"]
        print(f"process {len(runs)}: {len(ratios)} rounds; armed/none median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
        if len(runs) >= MIN_PROCESSES and settled([r["ratios"] for r in runs]):
            why = "the interval is narrower than the effect"
            break
        if time.monotonic() - began + took > BUDGET:
            why = "the time budget"
            break
    groups = [r["ratios"] for r in runs]
    median, low, high = grouped_ci(groups)
    stops = [ms for r in runs for ms in r["stop_ms"]]
    result = {"armed_over_none": median, "armed_over_none_low": low, "armed_over_none_high": high,
              "processes": len(runs), "rounds": sum(len(g) for g in groups), "phase_seconds": PHASE,
              "snapshot_interval_seconds": INTERVAL, "step_ms": statistics.median(r["step_ms"] for r in runs),
              "stopped_by": why, "stop_ms_median": statistics.median(stops)}
    per_process = ", ".join(f"{statistics.median(g):.3f}" for g in groups)
    print(f"{len(runs)} processes, {result['rounds']} rounds of {PHASE:.0f} s phases, {result['step_ms']:.3f} ms per "
          f"step unarmed; armed over none, median [95% CI]: {median:.4f} [{low:.4f}, {high:.4f}] ({per_process}); "
          f"stopped by {why}")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
