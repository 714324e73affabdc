"""A Keras 3 mixed-precision job whose loss overflows on known batches, with the tfprofd hook.

The loss-scale optimizer skips the update of each overflowing step (and halves its scale); the job
prints what really happened: batches run, updates applied (optimizer.iterations), steps skipped.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from tfprofd.exporter.hook import TfprofdCallback

BATCH = 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--overflow", type=int, nargs="*", default=[5, 17, 33, 50, 51, 90])
    args = p.parse_args()
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batches * BATCH, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    for b in args.overflow:
        x[b * BATCH:(b + 1) * BATCH] = 1e30  # inf in float16: the gradients of this batch overflow
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1, dtype="float32")])
    # A small initial loss scale: only the forced overflows make the optimizer skip a step.
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.001), initial_scale=2.0**4)
    model.compile(optimizer=optimizer, loss="mse")
    callback = TfprofdCallback(job=args.job, profiler=False)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=1, callbacks=[callback], verbose=0)
    callback.reporter.close()
    applied = int(model.optimizer.iterations.numpy())
    print(json.dumps({"batches": args.batches, "applied": applied, "skipped": args.batches - applied}), flush=True)


if __name__ == "__main__":
    main()
