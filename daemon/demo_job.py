"""A small Keras job with the tfprofd hook, for `tfprofd demo`, the tests and the benchmarks.

Run as ``python -m tfprofd.daemon.demo_job``; needs TensorFlow (``pip install 'tfprofd[tf]'``).

Prints one JSON line at the end with what it really trained: {"steps": N, "samples": N, "pid": N}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from tfprofd.exporter.hook import Reporter, TfprofdCallback

SLOW = {"delay": 0.0}  # read cost per record in seconds; --slow-after turns it on mid-run
READ_BLOCK = 64


def dataset(args: argparse.Namespace, repeat: bool) -> tf.data.Dataset:
    """Synthetic records read in blocks of 64 with a simulated read cost (like waiting on network storage)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, args.features)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if repeat:
        ds = ds.repeat()
    later = args.slow_after or args.slow_on_signal
    SLOW["delay"] = 0.0 if later else args.map_delay
    if args.map_delay or later:
        def read(block: np.ndarray) -> np.ndarray:
            if SLOW["delay"]:
                time.sleep(SLOW["delay"] * len(block))
            return block

        ds = ds.batch(READ_BLOCK).map(
            lambda a, b: (tf.ensure_shape(tf.numpy_function(read, [a], tf.float32), a.shape), b),
            num_parallel_calls=args.parallel_reads).unbatch()
    if args.keep_every > 1:  # the seed's network bottleneck: drop 9 of 10 records after reading them
        ds = ds.enumerate().filter(lambda i, r: i % args.keep_every == 0).map(lambda i, r: r)
    if args.heavy_map:  # the seed's overloaded preprocessing: a costly op per record on the CPU
        n = args.heavy_map

        def heavy(a: tf.Tensor, b: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            m = tf.reshape(tf.tile(a, [n * n // args.features + 1])[: n * n], [n, n])
            for _ in range(4):
                m = tf.tanh(tf.matmul(m, m) / n)
            return a + tf.reduce_mean(m) * 0, b

        ds = ds.map(heavy)
    return ds.batch(args.batch_size).prefetch(tf.data.AUTOTUNE)


def model(features: int, width: int, steps_per_execution: int) -> tf.keras.Model:
    m = tf.keras.Sequential([tf.keras.Input((features,)), tf.keras.layers.Dense(width, activation="relu"),
                             tf.keras.layers.Dense(width, activation="relu"),
                             tf.keras.layers.Dense(1, activation="sigmoid")])
    m.compile(optimizer="sgd", loss="binary_crossentropy", steps_per_execution=steps_per_execution)
    return m


class PostProcessing(tf.keras.callbacks.Callback):
    """The seed's heavy post-processing: builds random images from the outputs after every batch."""

    def __init__(self, milliseconds: float):
        super().__init__()
        self.seconds = milliseconds / 1000

    def on_train_batch_end(self, batch, logs=None):
        deadline = time.perf_counter() + self.seconds
        rng = np.random.default_rng(batch)
        while time.perf_counter() < deadline:
            rng.random((64, 32, 32)).astype("uint8")


def train_step_function(m: tf.keras.Model):
    optimizer = tf.keras.optimizers.SGD()
    loss_fn = tf.keras.losses.BinaryCrossentropy()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, m(x, training=True))
        grads = tape.gradient(loss, m.trainable_variables)
        optimizer.apply_gradients(zip(grads, m.trainable_variables, strict=True))
        return loss

    return train_step


def plain_profile(args: argparse.Namespace) -> None:
    """A custom loop profiled only with TensorFlow's own APIs, as users capture traces without tfprofd."""
    ds = dataset(args, repeat=True)
    m = model(args.features, args.width, 1)
    train_step = train_step_function(m)
    post = PostProcessing(args.post_ms) if args.post_ms else None
    started, profiling, step = time.monotonic(), None, 0
    for x, y in ds:
        now = time.monotonic() - started
        if profiling is None and now >= args.profile_after:
            tf.profiler.experimental.start(args.plain_profile)
            profiling = now
        elif profiling is not None and now >= profiling + args.profile_seconds:
            tf.profiler.experimental.stop()
            break
        step += 1
        with tf.profiler.experimental.Trace("train", step_num=step, _r=1):
            train_step(x, y)
        if post:
            post.on_train_batch_end(step)
        if args.pause_ms:
            time.sleep(args.pause_ms / 1000)
    print(json.dumps({"steps": step, "logdir": args.plain_profile}), flush=True)
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", default="testjob")
    p.add_argument("--worker", default=None, help="the worker name to report (default: from TF_CONFIG, else 0)")
    p.add_argument("--mode", choices=("fit", "custom"), default="fit")
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--explicit-batch-size", action="store_true")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-execution", type=int, default=1)
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--width", type=int, default=32, help="hidden units per layer")
    p.add_argument("--map-delay", type=float, default=0.0, help="seconds of simulated read cost per record")
    p.add_argument("--parallel-reads", type=int, default=tf.data.AUTOTUNE)
    p.add_argument("--keep-every", type=int, default=1, help="keep 1 of every N records read")
    p.add_argument("--heavy-map", type=int, default=0, help="size of a costly per-record matmul in map")
    p.add_argument("--post-ms", type=float, default=0.0, help="milliseconds of post-processing after each batch")
    p.add_argument("--slow-after", type=float, default=0.0, help="turn the --map-delay read cost on after N s")
    p.add_argument("--slow-for", type=float, default=0.0, help="with --slow-after: recover after this many s")
    p.add_argument("--slow-log", default="", help="append 'slow <unix time>' and 'recovered <unix time>' here")
    p.add_argument("--slow-on-signal", action="store_true",
                   help="turn the --map-delay read cost on when the process gets SIGUSR1 (the demo's injection)")
    p.add_argument("--seconds", type=float, default=0.0, help="train on a repeating dataset for this long")
    p.add_argument("--no-markers", action="store_true", help="no profiler step markers")
    p.add_argument("--idle", type=float, default=0.0, help="wait this long (reporting, profiler up) before training")
    p.add_argument("--pause-ms", type=float, default=0.0, help="custom loop: pause this long between steps")
    p.add_argument("--plain-profile", metavar="LOGDIR",
                   help="custom loop without the hook: profile it with TensorFlow's own APIs (Trace step markers, "
                        "tf.profiler.experimental.start/stop) into LOGDIR, then exit")
    p.add_argument("--profile-after", type=float, default=3.0, help="with --plain-profile: start after this many s")
    p.add_argument("--profile-seconds", type=float, default=2.0, help="with --plain-profile: profile this long")
    args = p.parse_args()
    if args.plain_profile:
        plain_profile(args)
        return

    batch = args.batch_size if args.explicit_batch_size else None
    ds = dataset(args, repeat=args.seconds > 0)
    m = model(args.features, args.width, args.steps_per_execution)
    if args.slow_after:
        def slow(delay: float, what: str) -> None:
            SLOW.update(delay=delay)
            if args.slow_log:
                with open(args.slow_log, "a") as f:
                    f.write(f"{what} {time.time()}\n")

        timers = [threading.Timer(args.slow_after, slow, (args.map_delay, "slow"))]
        if args.slow_for:
            timers.append(threading.Timer(args.slow_after + args.slow_for, slow, (0.0, "recovered")))
        for timer in timers:
            timer.daemon = True
            timer.start()
    if args.slow_on_signal:
        signal.signal(signal.SIGUSR1, lambda *_: SLOW.update(delay=args.map_delay))
    if args.mode == "fit":
        callback = TfprofdCallback(job=args.job, worker=args.worker, batch_size=batch,
                                   step_markers=not args.no_markers)
        time.sleep(args.idle)
        extra = [PostProcessing(args.post_ms)] if args.post_ms else []
        if args.seconds:
            steps = max(1, math.ceil(args.samples / args.batch_size))
            deadline = time.monotonic() + args.seconds

            class Until(tf.keras.callbacks.Callback):
                def on_train_batch_end(self, b, logs=None):
                    if time.monotonic() > deadline:
                        self.model.stop_training = True

            m.fit(ds, epochs=10**6, steps_per_epoch=steps, callbacks=[callback, *extra, Until()], verbose=0)
        else:
            m.fit(ds, epochs=args.epochs, callbacks=[callback, *extra], verbose=0)
        reporter = callback.reporter
        steps, samples, _ = reporter.report_counts()
    else:
        reporter = Reporter.shared(job=args.job, worker=args.worker)
        train_step = train_step_function(m)
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
