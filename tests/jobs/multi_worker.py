"""One worker of a MultiWorkerMirroredStrategy job (tf_keras: Keras 3's fit cannot run that strategy,
keras-team/keras#20585) with the tfprofd hook. TF_CONFIG names the cluster and this worker.

Prints one JSON line at the end: the steps and samples this worker really trained on.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np
import tensorflow as tf

from tfprofd.exporter.hook import TfprofdCallback

GLOBAL_BATCH = 64


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--report-interval", type=float, default=1.0)
    args = p.parse_args()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync  # one CPU replica per worker
    x = np.random.default_rng(0).normal(size=(args.steps * GLOBAL_BATCH, 16)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)  # sharded by the strategy
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((16,)), tf.keras.layers.Dense(64, activation="relu"),
                                     tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    callback = TfprofdCallback(job=args.job, interval=args.report_interval)
    model.fit(dataset, epochs=1, callbacks=[callback], verbose=0)
    callback.reporter.close()
    # What this worker trained on: every global step, on its shard of each global batch.
    print(json.dumps({"steps": args.steps, "samples": args.steps * GLOBAL_BATCH // workers,
                      "worker": callback.reporter.worker}), flush=True)
    os._exit(0)  # skip TensorFlow's teardown, which can hang with a collective executor still alive


if __name__ == "__main__":
    main()
