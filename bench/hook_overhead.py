"""The training hook's interference with the training it observes, as users get it, measured in one run.

A small Keras model (under 1 ms per step on this CPU, where a per-step cost shows most) trains with each
variant in turn:

- no callback, on a dataset whose batch size TensorFlow cannot know in advance (``.batch(16)``, the default);
- ``TfprofdCallback(job=...)`` with its defaults (profiler server started, step markers on, real batch sizes
  read from the count Keras 3's train step keeps anyway), on the same dataset;
- no callback and the default callback on a dataset with static batches (``drop_remainder=True``);
- Keras's own ``TensorBoard(update_freq="batch")``, the anchor;
- no callback again, the control: its ratio to the first shows what two identical runs differ by here.

Every variant runs on **one** model (the same weights in the same buffers) and calls the train function
fit() would call after the callback's ``on_train_begin``: Keras's own, since the hook adds nothing to a
Keras 3 train step. (Where it must count in the graph, a custom ``train_step`` or tf_keras, the train
function it rebuilds with its counting op measured 0.975 [0.966, 0.987] of no callback on dynamic batches.)

The variants take turns every ``BLOCK`` steps, in a new random order each round, through Keras's own
``CallbackList`` and train functions in the three lines of Keras 3's ``fit`` loop (``on_train_batch_begin``,
``train_function(iterator)``, ``on_train_batch_end``). A machine's speed drifts by several percent over
seconds (whole ``fit`` calls of 1,500 steps, the variants in rotated order, differed by ±5-10% here and
resolved nothing); turns of 25 steps see the same machine, so each variant's rate over the no-callback
turn of its round (paired) resolves a fraction of a percent within one process.

Between processes the same comparison moves by up to ±2% (the memory layout a process draws), so the
measure runs in ``MIN_PROCESSES`` to ``MAX_PROCESSES`` fresh worker processes, one after another,
``SECONDS`` each. The median of all
paired ratios gets a 95% interval from a two-level bootstrap (processes, then rounds within each), and more
processes run until that interval lies on one side of the 0.99 target and is narrower than the distance of
the median from 1 (the spread is below the effect), or is within ±0.25%, and the control's holds 1.

Each process also times the callback's per-batch hooks in a tight loop with profiling off (target < 2 us)
and one report. Target: median ratio >= 0.99 for the default callback.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from keras.src.callbacks.callback_list import CallbackList

from tfprofd.exporter.hook import TfprofdCallback

QUICK = "--quick" in sys.argv  # one process of a second, small loops: the bench runs, no target means anything
STEPS = 1500  # of the dataset
BATCH = 16
BLOCK = 25  # steps per turn
SECONDS = 1 if QUICK else 60  # of turns per process
MIN_PROCESSES, MAX_PROCESSES = (1, 1) if QUICK else (4, 10)
MICRO = 2_000 if QUICK else 200_000  # iterations of the per-batch hooks (a report: a hundredth of that)
TARGET = 0.99
PRECISE = 0.0025  # a confidence interval within ±0.25% is precise enough whatever the effect
# Fewer, steadier threads on a small machine: round-to-round noise otherwise dwarfs the effect.
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)

BASELINE_OF = {"tfprofd": "none", "tfprofd_static": "none_static", "tensorboard": "none", "control": "none"}


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
                          keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)])
    m.compile(optimizer="sgd", loss="mse")
    return m


def grouped_ci(groups: list[list[float]], draws: int = 1000) -> tuple[float, float, float]:
    """(median, low, high) of the pooled values; the 95% interval resamples groups, then values in each."""
    rng = random.Random(0)
    medians = sorted(statistics.median([v for g in rng.choices(groups, k=len(groups))
                                        for v in rng.choices(g, k=len(g))]) for _ in range(draws))
    return statistics.median([v for g in groups for v in g]), medians[int(0.025 * draws)], medians[int(0.975 * draws)]


def paired(measured: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each variant's rate over its baseline's in the same round."""
    return {v: [a / b for a, b in zip(measured[v], measured[base], strict=True)] for v, base in BASELINE_OF.items()}


def settled(groups: list[list[float]]) -> bool:
    median, low, high = grouped_ci(groups)
    half = (high - low) / 2
    return half < PRECISE or (half < abs(1 - median) and not low < TARGET < high)


def begun(model: keras.Model, callbacks: list[keras.callbacks.Callback]) -> CallbackList:
    """The callbacks as fit() holds them once training and its first epoch have begun."""
    callback_list = CallbackList(callbacks, add_history=True, add_progbar=False, verbose=0, epochs=1, steps=None,
                                 model=model)
    callback_list.on_train_begin()
    callback_list.on_epoch_begin(0)
    return callback_list


class Turn:
    """One variant of the interleaved measure: its callbacks, train function and iterator, as fit has them."""

    def __init__(self, callbacks: CallbackList, train_function: Callable[[Any], Any], dataset: tf.data.Dataset):
        self.callbacks = callbacks
        self.train_function = train_function
        self.iterator = iter(dataset.repeat())
        self.step = 0

    def run(self, steps: int) -> float:
        """Seconds ``steps`` steps took, through the lines of Keras 3's fit loop."""
        callbacks, train_function, iterator, first = self.callbacks, self.train_function, self.iterator, self.step
        started = time.perf_counter()
        for step in range(first, first + steps):
            callbacks.on_train_batch_begin(step)
            logs = train_function(iterator)
            callbacks.on_train_batch_end(step, logs)
        elapsed = time.perf_counter() - started
        self.step = first + steps
        return elapsed


def interleaved(model: keras.Model, dynamic: tf.data.Dataset, static: tf.data.Dataset, logdir: str) -> dict:
    """Each variant's paired ratios in this process, and the no-callback step time."""
    for ds in (static, dynamic):  # trace the plain train function for both batch shapes, static first
        model.fit(ds.take(20), epochs=1, verbose=0)
    plain = model.train_function
    turns = {
        "none": Turn(begun(model, []), plain, dynamic),
        "control": Turn(begun(model, []), plain, dynamic),
        "none_static": Turn(begun(model, []), plain, static),
        "tensorboard": Turn(begun(model, [keras.callbacks.TensorBoard(logdir, update_freq="batch")]), plain, dynamic),
    }
    hooked = begun(model, [TfprofdCallback(job="bench")]), begun(model, [TfprofdCallback(job="bench-static")])
    hooked_function = model.train_function  # as fit() calls it after the callbacks' on_train_begin
    turns["tfprofd"] = Turn(hooked[0], hooked_function, dynamic)
    turns["tfprofd_static"] = Turn(hooked[1], hooked_function, static)
    for name in ("tfprofd_static", *turns):  # warm-up: trace a rebuilt function, if any (static first), fill caches
        turns[name].run(BLOCK * 4)
    times: dict[str, list[float]] = {name: [] for name in turns}
    rng = random.Random()
    started = time.monotonic()
    while time.monotonic() - started < SECONDS:
        order = list(turns)
        rng.shuffle(order)
        for name in order:
            times[name].append(BLOCK / turns[name].run(BLOCK))  # steps per second
    for callbacks in hooked:
        callbacks.on_train_end()
    return {"ratios": paired(times), "step_ms": 1000 / statistics.median(times["none"])}


def micro(model: keras.Model) -> dict[str, float]:
    """The callback's per-batch hooks in a tight loop (profiling off) and one report, in microseconds."""
    callback = TfprofdCallback(job="micro", profiler=False)
    callback.set_model(model)
    n = MICRO
    t0 = time.perf_counter()
    for i in range(n):  # Keras calls both; the callback's own work is in the first
        callback.on_train_batch_begin(i)
        callback.on_train_batch_end(i)
    per_batch_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _i in range(n):
        pass
    hook_us = per_batch_us - (time.perf_counter() - t0) / n * 1e6
    callback.on_train_begin()  # the exact counts a report reads from TensorFlow, as during fit()
    callback.on_epoch_begin(0)
    callback.on_train_batch_begin(0)  # opens the count's segment: a report reads the TensorFlow variable
    n = MICRO // 100
    t0 = time.perf_counter()
    for _i in range(n):
        callback.reporter.flush()
    return {"hook_us": hook_us, "report_us": (time.perf_counter() - t0) / n * 1e6}


def worker() -> None:
    """One process's measure, as JSON on the last line of stdout."""
    x = np.random.default_rng(0).normal(size=(STEPS * BATCH + 5, 32)).astype("float32")  # a partial last batch
    y = x.sum(axis=1, keepdims=True)
    data = tf.data.Dataset.from_tensor_slices((x, y))
    model = make_model()
    result = interleaved(model, data.batch(BATCH).cache(), data.batch(BATCH, drop_remainder=True).cache(),
                         tempfile.mkdtemp())
    result.update(micro(model))
    print(json.dumps(result))


def main() -> dict[str, float]:
    runs: list[dict] = []
    while len(runs) < MAX_PROCESSES:
        out = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], capture_output=True, text=True,
                             check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        ratios = {v: [run["ratios"][v] for run in runs] for v in BASELINE_OF}
        medians = "  ".join(f"{v} {statistics.median(ratios[v][-1]):.4f}" for v in BASELINE_OF)
        print(f"process {len(runs)}: {len(ratios['control'][-1])} rounds; {medians}", flush=True)
        _, low, high = grouped_ci(ratios["control"])
        if (len(runs) >= MIN_PROCESSES and low <= 1 <= high and settled(ratios["tfprofd"])
                and settled(ratios["tfprofd_static"])):
            break
    step_ms = statistics.median(run["step_ms"] for run in runs)
    rounds = sum(len(run["ratios"]["control"]) for run in runs)
    result: dict[str, float] = {"processes": len(runs), "rounds": rounds, "step_ms": step_ms}
    print(f"{len(runs)} processes, {rounds} rounds of {BLOCK}-step turns, {step_ms:.3f} ms per step without "
          "callback; paired ratios to no callback, median [95% CI] (per-process medians):")
    for variant in BASELINE_OF:
        groups = [run["ratios"][variant] for run in runs]
        median, low, high = grouped_ci(groups)
        result[variant], result[f"{variant}_low"], result[f"{variant}_high"] = median, low, high
        target = "  (target >= 0.99)" if variant.startswith("tfprofd") else ""
        per_process = ", ".join(f"{statistics.median(g):.3f}" for g in groups)
        print(f"  {variant:15s} {median:.4f} [{low:.4f}, {high:.4f}]{target}  ({per_process})")
    for key, what in (("hook_us", "per-batch cost of the callback's hooks, profiling off (target < 2 us)"),
                      ("report_us", "one report (the reporter thread's work each second)")):
        result[key] = statistics.median(run[key] for run in runs)
        print(f"{what}: {result[key]:.2f} us")
    return result


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
