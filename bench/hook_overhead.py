"""The training hook's interference with the training it observes, as users get it, measured in one run.

A small Keras model (about 1 ms per step on this CPU, where a per-step cost shows most) trains in short
fit() calls, one per variant per round, the order rotated each round:

- no callback, on a dataset whose batch size TensorFlow cannot know in advance (``.batch(16)``, the default);
- ``TfprofdCallback(job=...)`` with its defaults (profiler server started, step markers on, real batch sizes
  counted in the train step), on the same dataset;
- no callback and the default callback on a dataset with static batches (``drop_remainder=True``), where the
  hook adds no op to the train step: both run on one model, so their ratio is the hook's cost alone;
- Keras's own ``TensorBoard(update_freq="batch")``, the anchor;
- a second no-callback run of that same model, the control: its ratio to the first shows what two identical
  runs differ by here, the floor under every other ratio.

The dynamic pair runs on two model instances (the callback's counting op must not reach the baseline); its
ratio also holds whatever two identical models differ by (about 1% on this machine, measured before).
The reporter thread, once started, keeps running through later baseline runs, so its cost (one report a
second) is in no ratio; the microbenchmark below times one report apart.

Each variant's ratio is taken against the no-callback run of the same round and dataset (paired), and
rounds go on until the 95% confidence interval of the median ratio (bootstrap) lies on one side of the
0.99 target and is narrower than the distance of the median from 1 (the spread is below the effect), or
until it is within ±0.25%.
Target: median ratio >= 0.99 for the default callback. Then a microbenchmark of the callback's per-batch
hooks with profiling off (target < 2 us).
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from tfprofd.exporter.hook import TfprofdCallback

STEPS = 1500
BATCH = 16
MIN_ROUNDS, MAX_ROUNDS, MAX_SECONDS = 30, 400, 600
TARGET = 0.99
PRECISE = 0.0025  # a confidence interval within ±0.25% is precise enough whatever the effect
# Fewer, steadier threads on a small machine: round-to-round noise otherwise dwarfs the effect.
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
                          keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)])
    m.compile(optimizer="sgd", loss="mse")
    return m


def median_ci(ratios: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """(median, low, high): the median and a bootstrap 95% interval of it."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return statistics.median(ratios), medians[int(0.025 * draws)], medians[int(0.975 * draws)]


def paired(rates: dict[str, list[float]], baseline_of: dict[str, str]) -> dict[str, list[float]]:
    """Each variant's rate over its baseline's in the same round."""
    return {v: [a / b for a, b in zip(rates[v], rates[base], strict=True)] for v, base in baseline_of.items()}


def settled(ratios: list[float]) -> bool:
    median, low, high = median_ci(ratios)
    half = (high - low) / 2
    return half < PRECISE or (half < abs(1 - median) and not low < TARGET < high)


def main() -> dict[str, float]:
    x = np.random.default_rng(0).normal(size=(STEPS * BATCH + 5, 32)).astype("float32")  # a partial last batch
    y = x.sum(axis=1, keepdims=True)
    data = tf.data.Dataset.from_tensor_slices((x, y))
    dynamic = data.batch(BATCH).cache()
    static = data.batch(BATCH, drop_remainder=True).cache()
    logdir = tempfile.mkdtemp()
    # The dynamic-batch pair needs two models: the callback wraps its model's train step with a counting op
    # that a baseline must not run. On static batches the wrapped step has no extra op, so the callback and
    # its baseline (and the control) share one model: no difference of model instances in their ratio.
    dynamic_none, dynamic_hooked, static_model = make_model(), make_model(), make_model()
    variants = {
        "none": (dynamic_none, dynamic, lambda: []),
        "tfprofd": (dynamic_hooked, dynamic, lambda: [TfprofdCallback(job="bench")]),
        "none_static": (static_model, static, lambda: []),
        "tfprofd_static": (static_model, static, lambda: [TfprofdCallback(job="bench-static")]),
        "tensorboard": (make_model(), dynamic, lambda: [keras.callbacks.TensorBoard(logdir, update_freq="batch")]),
        "control": (static_model, static, lambda: []),
    }
    baseline_of = {"tfprofd": "none", "tfprofd_static": "none_static", "tensorboard": "none",
                   "control": "none_static"}
    for model, ds, callbacks in variants.values():  # warm-up: trace and build every train function
        model.fit(ds, epochs=1, callbacks=callbacks(), verbose=0)
    rates: dict[str, list[float]] = {name: [] for name in variants}  # samples per second of wall time
    cpu_rates: dict[str, list[float]] = {name: [] for name in variants}  # per second of the process's CPU time
    names = list(variants)
    started = time.monotonic()
    rounds = 0
    while rounds < MAX_ROUNDS and time.monotonic() - started < MAX_SECONDS:
        for name in names[rounds % len(names):] + names[:rounds % len(names)]:
            model, ds, callbacks = variants[name]
            cbs = callbacks()
            t0, c0 = time.perf_counter(), time.process_time()
            model.fit(ds, epochs=1, callbacks=cbs, verbose=0)
            rates[name].append(STEPS * BATCH / (time.perf_counter() - t0))
            cpu_rates[name].append(STEPS * BATCH / (time.process_time() - c0))
        rounds += 1
        ratios = paired(cpu_rates, baseline_of)
        if rounds % 10 == 0:
            print(f"  round {rounds}: median CPU-time ratio of the default callback so far "
                  f"{statistics.median(ratios['tfprofd']):.4f}", flush=True)
        if rounds >= MIN_ROUNDS and settled(ratios["tfprofd"]) and settled(ratios["tfprofd_static"]):
            break
    step_ms = BATCH * 1000 / statistics.median(rates["none"])
    print(f"{rounds} rounds ({time.monotonic() - started:.0f} s) of {STEPS} steps, batch {BATCH}, "
          f"{step_ms:.2f} ms per step without callback; paired ratios to no callback, median [95% CI]:")
    result: dict[str, float] = {"rounds": rounds, "step_ms": step_ms}
    for clock, measured in (("wall", rates), ("cpu", cpu_rates)):
        print(f" samples per second of {'wall' if clock == 'wall' else 'CPU'} time:")
        for variant, ratio in paired(measured, baseline_of).items():
            median, low, high = median_ci(ratio)
            result[f"{clock}_{variant}"], result[f"{clock}_{variant}_low"], result[f"{clock}_{variant}_high"] = \
                median, low, high
            target = "  (target >= 0.99)" if variant.startswith("tfprofd") else ""
            print(f"  {variant:15s} {statistics.median(measured[variant]):9.0f} against "
                  f"{statistics.median(measured[baseline_of[variant]]):9.0f}: {median:.4f} "
                  f"[{low:.4f}, {high:.4f}]{target}")

    callback = TfprofdCallback(job="micro", profiler=False)
    callback.set_model(variants["tfprofd"][0])
    n = 200_000
    t0 = time.perf_counter()
    for i in range(n):
        callback.on_train_batch_begin(i)
        callback.on_train_batch_end(i)
    per_batch_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _i in range(n):
        pass
    result["hook_us"] = per_batch_us - (time.perf_counter() - t0) / n * 1e6
    print(f"per-batch cost of the callback's hooks, profiling off: {result['hook_us']:.2f} us  (target < 2 us)")
    callback.on_train_begin()  # the exact counts a report reads from TensorFlow, as during fit()
    n = 2000
    t0 = time.perf_counter()
    for _i in range(n):
        callback.reporter.flush()
    result["report_us"] = (time.perf_counter() - t0) / n * 1e6
    print(f"one report (the reporter thread's work each second): {result['report_us']:.0f} us")
    return result


if __name__ == "__main__":
    main()
