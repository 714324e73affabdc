"""A small Keras job with the tfprofd hook, for tests, benchmarks and the demo.

Prints one JSON line at the end with what it really trained: {"steps": N, "samples": N, "pid": N}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from tfprofd.exporter.hook import Reporter, TfprofdCallback


def dataset(samples: int, batch: int, features: int, map_delay: float, repeat: bool) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if map_delay:
        def slow(a, b):
            return tf.numpy_function(lambda v: (time.sleep(map_delay), v)[1], [a], tf.float32), b
        ds = ds.map(slow)
        ds = ds.map(lambda a, b: (tf.ensure_shape(a, [features]), b))
    if repeat:
        ds = ds.repeat()
    return ds.batch(batch)


def model(features: int, steps_per_execution: int) -> tf.keras.Model:
    m = tf.keras.Sequential([tf.keras.Input((features,)), tf.keras.layers.Dense(32, activation="relu"),
                             tf.keras.layers.Dense(1, activation="sigmoid")])
    m.compile(optimizer="sgd", loss="binary_crossentropy", steps_per_execution=steps_per_execution)
    return m


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", default="testjob")
    p.add_argument("--mode", choices=("fit", "custom"), default="fit")
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--explicit-batch-size", action="store_true")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-execution", type=int, default=1)
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--map-delay", type=float, default=0.0, help="seconds of sleep per record in the input map")
    p.add_argument("--seconds", type=float, default=0.0, help="train on a repeating dataset for this long")
    args = p.parse_args()

    batch = args.batch_size if args.explicit_batch_size else None
    ds = dataset(args.samples, args.batch_size, args.features, args.map_delay, repeat=args.seconds > 0)
    m = model(args.features, args.steps_per_execution)
    if args.mode == "fit":
        callback = TfprofdCallback(job=args.job, batch_size=batch)
        if args.seconds:
            steps = max(1, math.ceil(args.samples / args.batch_size))
            deadline = time.monotonic() + args.seconds

            class Until(tf.keras.callbacks.Callback):
                def on_train_batch_end(self, b, logs=None):
                    if time.monotonic() > deadline:
                        self.model.stop_training = True

            history = m.fit(ds, epochs=10**6, steps_per_epoch=steps, callbacks=[callback, Until()], verbose=0)
            del history
        else:
            m.fit(ds, epochs=args.epochs, callbacks=[callback], verbose=0)
        reporter = callback.reporter
        steps, samples = reporter.exact_counts()
    else:
        reporter = Reporter.shared(job=args.job)
        optimizer = tf.keras.optimizers.SGD()
        loss_fn = tf.keras.losses.BinaryCrossentropy()

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, m(x, training=True))
            grads = tape.gradient(loss, m.trainable_variables)
            optimizer.apply_gradients(zip(grads, m.trainable_variables, strict=True))
            return loss

        steps = samples = 0
        for _ in range(args.epochs):
            for x, y in ds:
                with reporter.step(batch_size=int(x.shape[0])):
                    train_step(x, y)
                steps += 1
                samples += int(x.shape[0])
    reporter.close()
    print(json.dumps({"steps": steps, "samples": samples, "pid": os.getpid(),
                      "profiler": reporter.profiler_address}), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # TensorFlow can hang in interpreter teardown while tf.data threads run a numpy_function on a
    # repeating dataset; everything is reported and flushed, so leave without the teardown.
    os._exit(0)


if __name__ == "__main__":
    main()
