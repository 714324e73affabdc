"""Make one trace of the recorded scenario corpus: a small CPU training job whose steps come from one SOURCE
(how the profile marks, or does not mark, its steps) and whose time goes to one CAUSE.

    python tests/jobs/corpus.py SOURCE CAUSE LOGDIR [--steps-per-execution N] [--seconds S]

Sources: ``hook_keras3`` / ``hook_tf_keras`` (fit with TfprofdCallback's markers, under Keras 3 or tf_keras),
``keras3_tensorboard`` (Keras 3's ``TensorBoard(profile_batch=(a, b))``: its own "Profiled batch" markers),
``tf_keras_fit`` (tf_keras's own ``Trace("train", step_num, _r=1)`` in fit, profiled with
tf.profiler.experimental.start/stop), ``custom_markers`` / ``custom_unmarked`` (a custom loop with or without
``Trace`` step markers).
Causes: ``input`` (a slow tf.data read), ``callback`` (slow host work after each step), ``compute`` (a big
model), ``small_batch`` (batch 2 of a tiny model: per-step overhead dominates).

Every cause is far from tfprofd's thresholds (input wait and callback time are most of the step, ops run
almost all of a compute step and little of a small-batch one), so the verdict does not hinge on how busy the
recording machine was. Prints one JSON line: the source, cause, steps profiled and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SOURCES = ("hook_keras3", "hook_tf_keras", "keras3_tensorboard", "tf_keras_fit", "custom_markers", "custom_unmarked")
CAUSES = ("input", "callback", "compute", "small_batch")
# Per cause: features, hidden width, batch size, read delay per batch (s), host work per step (s).
# Input, callback and compute share one model, so a compute trace is the others' healthy baseline.
SHAPES = {"input": (64, 1024, 256, 0.08, 0.0), "callback": (64, 1024, 256, 0.0, 0.06),
          "compute": (64, 1024, 256, 0.0, 0.0), "small_batch": (8, 16, 2, 0.0, 0.0)}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", choices=SOURCES)
    p.add_argument("cause", choices=CAUSES)
    p.add_argument("logdir")
    p.add_argument("--steps-per-execution", type=int, default=1, help="Keras sources only")
    p.add_argument("--seconds", type=float, default=1.0, help="how long to profile (about)")
    p.add_argument("--read-delay", type=float, help="input cause: seconds each batch's read waits")
    p.add_argument("--warmup", type=float, default=3.0, help="train this long before profiling")
    return p.parse_args()


ARGS = parse()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_USE_LEGACY_KERAS"] = "1" if ARGS.source in ("hook_tf_keras", "tf_keras_fit") else "0"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if ARGS.source in ("hook_tf_keras", "tf_keras_fit"):
    import tf_keras as keras
else:
    import keras
FEATURES, WIDTH, BATCH, READ_DELAY, HOST_WORK = SHAPES[ARGS.cause]
if ARGS.read_delay is not None and READ_DELAY:
    READ_DELAY = ARGS.read_delay


def dataset() -> tf.data.Dataset:
    """Synthetic batches, repeated; with the input cause each batch waits READ_DELAY (a slow remote read)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * 8, FEATURES)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    # Batches made whole (not record by record): the trace holds a few tf.data events per step, not per record.
    ds = tf.data.Dataset.from_tensor_slices((x.reshape(8, BATCH, FEATURES), y.reshape(8, BATCH, 1))).repeat()
    if READ_DELAY:
        def read(block: np.ndarray) -> np.ndarray:
            time.sleep(READ_DELAY)
            return block

        ds = ds.map(lambda a, b: (tf.ensure_shape(tf.numpy_function(read, [a], tf.float32), a.shape), b),
                    num_parallel_calls=1)
    return ds.prefetch(1)


def host_work(step: int) -> None:
    """Post-processing on the host: builds images from random numbers for HOST_WORK seconds."""
    deadline = time.perf_counter() + HOST_WORK
    rng = np.random.default_rng(step)
    while time.perf_counter() < deadline:
        rng.random((64, 32, 32)).astype("uint8")


def build() -> keras.Model:
    m = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(WIDTH, activation="relu"),
                          keras.layers.Dense(WIDTH, activation="relu"), keras.layers.Dense(1, activation="sigmoid")])
    m.compile(optimizer="sgd", loss="binary_crossentropy", steps_per_execution=ARGS.steps_per_execution)
    return m


class PostProcessing(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        host_work(batch)


class Timer(keras.callbacks.Callback):
    """Measures the time per execution during the warm-up fit and stops it after ARGS.warmup seconds."""

    def on_train_begin(self, logs=None):
        self.started, self.batches, self.first = time.perf_counter(), 0, 0.0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.batches == 2:  # past the first execution, which builds the train function
            self.first = time.perf_counter()
        elif time.perf_counter() - self.started >= ARGS.warmup and self.batches >= 5:
            self.model.stop_training = True

    def per_batch(self) -> float:
        return (time.perf_counter() - self.first) / (self.batches - 2)


class Window(keras.callbacks.Callback):
    """Profiles from execution ``first`` for ARGS.seconds (at least 3 executions) with
    tf.profiler.experimental.start/stop, then ends the fit. Listed first, so the session records before the other
    callbacks' batch-begin hooks (the hook's marker starts there)."""

    def __init__(self, first: int, logdir: str):
        super().__init__()
        self.first, self.logdir, self.seen, self.started = first, logdir, 0, 0.0

    def on_train_batch_begin(self, batch, logs=None):
        if self.seen == self.first:
            tf.profiler.experimental.start(self.logdir)
            self.started = time.perf_counter()
        elif self.seen >= self.first + 3 and time.perf_counter() - self.started >= ARGS.seconds:
            tf.profiler.experimental.stop()
            self.model.stop_training = True
        self.seen += 1


class Stop(keras.callbacks.Callback):
    """Ends the fit after its last profiled batch (the TensorBoard sources profile by batch numbers)."""

    def __init__(self, last: int):
        super().__init__()
        self.last, self.seen = last, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen > self.last:
            self.model.stop_training = True


def fit(model: keras.Model) -> int:
    """Warm up (the train function is built and cached), then profile about ARGS.seconds of executions."""
    ds = dataset()
    extra = [PostProcessing()] if HOST_WORK else []
    hook = []
    if ARGS.source.startswith("hook_"):
        from tfprofd.exporter.hook import TfprofdCallback

        # No agent: reports go to a socket nobody listens on; no profiler server (the session is local).
        hook = [TfprofdCallback(job=f"corpus-{ARGS.cause}", addr=f"unix:{ARGS.logdir}/no-agent.sock",
                                profiler=False)]
    timer = Timer()
    model.fit(ds, epochs=1, steps_per_epoch=10**6, callbacks=[timer, *hook, *extra], verbose=0)
    executions = max(3, round(ARGS.seconds / timer.per_batch()))
    first = 2
    if ARGS.source == "keras3_tensorboard":
        # The TensorBoard callback's markers start in its batch-begin hook and end in its batch-end hook; the
        # post-processing callback listed after it runs between them (as callbacks=[tensorboard, mine] do). It
        # profiles a range of batches: as many as the warm-up's pace fits in ARGS.seconds.
        callbacks = [keras.callbacks.TensorBoard(ARGS.logdir, profile_batch=(first + 1, first + executions)),
                     *extra, Stop(first + executions)]
    else:  # tf_keras's fit marks its steps itself whenever a session records
        callbacks = [Window(first, ARGS.logdir), *hook, *extra]
    model.fit(ds, epochs=1, steps_per_epoch=10**6, callbacks=callbacks, verbose=0)
    return executions


def custom(model: keras.Model) -> int:
    """A custom loop: a tf.function train step, optionally wrapped in Trace step markers; profiled for
    ARGS.seconds after ARGS.warmup seconds."""
    optimizer = keras.optimizers.SGD()
    loss_fn = keras.losses.BinaryCrossentropy()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    started, profiling, step, profiled = time.perf_counter(), None, 0, 0
    for x, y in dataset():
        now = time.perf_counter()
        if profiling is None and now - started >= ARGS.warmup:
            tf.profiler.experimental.start(ARGS.logdir)
            profiling = now
        elif profiling is not None and now - profiling >= ARGS.seconds:
            tf.profiler.experimental.stop()
            return profiled
        step += 1
        if ARGS.source == "custom_markers":
            with tf.profiler.experimental.Trace("train", step_num=step, _r=1):
                train_step(x, y)
        else:
            train_step(x, y)
        if HOST_WORK:
            host_work(step)
        profiled += profiling is not None
    raise AssertionError("the dataset repeats forever")


def main() -> None:
    if ARGS.steps_per_execution > 1 and ARGS.source.startswith("custom"):
        sys.exit("--steps-per-execution is for the Keras sources")
    model = build()
    profiled = custom(model) if ARGS.source.startswith("custom") else fit(model)
    print(json.dumps({"source": ARGS.source, "cause": ARGS.cause, "steps_per_execution": ARGS.steps_per_execution,
                      "profiled": profiled, "tensorflow": tf.__version__, "keras": keras.__version__}), flush=True)
    os._exit(0)  # tf.data threads may still run a numpy_function: leave without the interpreter's teardown


if __name__ == "__main__":
    main()
