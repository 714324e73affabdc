"""Issue 3: the information-interference trade-off of the training hook, measured in one run.

Alternating rounds of a tiny Keras model (step time around 1 ms, where overhead shows most) with no
callback, tfprofd's callback, and Keras's own TensorBoard(update_freq="batch") as the anchor; then a
microbenchmark of the callback's per-batch hooks with profiling off.
Targets: throughput with/without >= 0.99; per-batch cost < 2 us.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from tfprofd.exporter.hook import TfprofdCallback

ROUNDS = 20
STEPS = 1000
BATCH = 16
# Fewer, steadier threads on a small machine: round-to-round noise otherwise exceeds the 1% being measured.
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)


def make_model() -> tf.keras.Model:
    tf.keras.utils.set_random_seed(0)
    m = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(8, activation="relu"),
                             tf.keras.layers.Dense(1)])
    m.compile(optimizer="sgd", loss="mse")
    return m


def main() -> dict[str, float]:
    x = np.random.default_rng(0).normal(size=(STEPS * BATCH, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).cache()
    logdir = tempfile.mkdtemp()
    # One model per variant, so tfprofd's batch counting never runs in the baseline's train step.
    variants = {
        "none": (make_model(), lambda: []),
        "tfprofd": (make_model(), lambda: [TfprofdCallback(job="bench", profiler=False)]),
        "tfprofd_batch_size": (make_model(), lambda: [TfprofdCallback(job="bench2", profiler=False, batch_size=BATCH)]),
        "tensorboard": (make_model(), lambda: [tf.keras.callbacks.TensorBoard(logdir, update_freq="batch")]),
    }
    for model, callbacks in variants.values():  # warm-up: trace and build every train function
        model.fit(ds, epochs=1, callbacks=callbacks(), verbose=0)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(ROUNDS):
        # Rotate the order each round so no variant always runs right after another.
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            model, callbacks = variants[name]
            cbs = callbacks()
            started = time.perf_counter()
            model.fit(ds, epochs=1, callbacks=cbs, verbose=0)
            rates[name].append(STEPS * BATCH / (time.perf_counter() - started))
    median = {name: statistics.median(v) for name, v in rates.items()}

    cb = TfprofdCallback(job="micro", profiler=False)
    cb.set_model(variants["tfprofd"][0])
    n = 200_000
    started = time.perf_counter()
    for i in range(n):
        cb.on_train_batch_begin(i)
        cb.on_train_batch_end(i)
    per_batch_us = (time.perf_counter() - started) / n * 1e6
    started = time.perf_counter()
    for _i in range(n):
        pass
    per_batch_us -= (time.perf_counter() - started) / n * 1e6

    r = {"none_sps": median["none"], "tfprofd_sps": median["tfprofd"], "tensorboard_sps": median["tensorboard"],
         "tfprofd_bs_sps": median["tfprofd_batch_size"],
         "tfprofd_ratio": median["tfprofd"] / median["none"],
         "tensorboard_ratio": median["tensorboard"] / median["none"],
         "tfprofd_bs_ratio": median["tfprofd_batch_size"] / median["none"],
         "hook_us": per_batch_us, "step_ms": BATCH * 1000 / median["none"]}
    print(f"{ROUNDS} alternating rounds of {STEPS} steps, batch {BATCH}, median samples/s "
          f"(step {r['step_ms']:.2f} ms without callback):")
    print(f"  no callback            {r['none_sps']:10.0f}")
    print(f"  tfprofd callback       {r['tfprofd_sps']:10.0f}  ratio {r['tfprofd_ratio']:.4f}  (target >= 0.99)")
    print(f"  tfprofd, batch_size=   {r['tfprofd_bs_sps']:10.0f}  ratio {r['tfprofd_bs_ratio']:.4f}")
    print(f"  TensorBoard per batch  {r['tensorboard_sps']:10.0f}  ratio {r['tensorboard_ratio']:.4f}")
    print(f"per-batch cost of the callback's hooks, profiling off: {r['hook_us']:.2f} us  (target < 2 us)")
    return r


if __name__ == "__main__":
    main()
