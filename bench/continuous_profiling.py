"""What continuous profiling armed by the agent costs the training it watches, side by side in one run.

The hook-overhead bench's small Keras model (under 1 ms per step on this CPU, where a per-step cost shows
most) trains with the default ``TfprofdCallback`` (profiler server, step markers) through the lines of
Keras 3's fit loop. Phases of ``PHASE`` seconds alternate, in a new random order each round: **none**
(nothing armed) and **armed** (the agent's snapshot worker arms ``StartContinuousProfiling`` in this
process and takes a snapshot every 2 s into its ring, exactly as while a rule is pending; the ring is
dropped at the end of the phase). Each armed phase's steps/s over the none phase of its round (paired)
is one ratio; the median and range over ``ROUNDS`` rounds are printed as JSON.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import tensorflow as tf
from hook_overhead import BATCH, Turn, begun, make_model

from tfprofd.daemon.pending import RingWorker
from tfprofd.exporter.hook import TfprofdCallback

from common import free_port

QUICK = "--quick" in sys.argv  # one short round: the bench runs, the figure means nothing
ROUNDS = 1 if QUICK else 8
PHASE = 1.5 if QUICK else 6.0  # seconds per phase: three snapshots at 2 s
INTERVAL = 0.5 if QUICK else 2.0


def phase(turn: Turn, seconds: float) -> float:
    """Steps per second over ``seconds`` of training."""
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        steps += 25
        turn.run(25)
    return steps / (time.perf_counter() - started)


def main() -> dict[str, float]:
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
    request = {"mode": "agent", "targets": [f"127.0.0.1:{port}"], "duration_ms": 1000, "max_trace_bytes": 256 << 20,
               "host_tracer_level": 2, "device_tracer_level": 1, "python_tracer_level": 0, "delay_ms": 0,
               "interval": INTERVAL, "keep": 8, "max_bytes": 64 << 20, "rpc_timeout": 30.0, "min_s": 0.0,
               "deadline_s": 3600}
    ratios, snapshot_ms = [], []
    with tempfile.TemporaryDirectory() as logdir:
        for _ in range(ROUNDS):
            rates = {}
            for variant in random.sample(["none", "armed"], 2):
                if variant == "armed":
                    ring = RingWorker({**request, "logdir": logdir})
                    assert ring.answer(30).get("armed"), "continuous profiling could not be armed"
                rates[variant] = phase(turn, PHASE)
                if variant == "armed":
                    started = time.perf_counter()
                    ring.finish("drop", 30)
                    snapshot_ms.append((time.perf_counter() - started) * 1000)
            ratios.append(rates["armed"] / rates["none"])
    return {"armed_over_none_median": statistics.median(ratios), "armed_over_none_min": min(ratios),
            "armed_over_none_max": max(ratios), "rounds": ROUNDS, "phase_seconds": PHASE,
            "snapshot_interval_seconds": INTERVAL, "stop_ms_median": statistics.median(snapshot_ms)}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
