"""A Keras job with the tfprofd hook whose own TensorBoard callback profiles (almost) every batch."""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

from tfprofd.exporter.hook import TfprofdCallback


class Slow(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.01)


def main() -> None:
    logdir = sys.argv[1]
    x, y = np.ones((64000, 4), "float32"), np.ones((64000, 1), "float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    callbacks = [TfprofdCallback(job="tensorboard"), keras.callbacks.TensorBoard(logdir, profile_batch=(2, 10**6)),
                 Slow()]
    model.fit(x, y, batch_size=32, epochs=1, callbacks=callbacks, verbose=0)


if __name__ == "__main__":
    main()
