"""A user's 2-worker script, for test_output.py: what a person reads.

keras.io-style: a small convnet with `BatchNormalization`, a `tf.data`
pipeline, `BackupAndRestore` (its saves pass barriers), 3 epochs of `fit`
with Keras' progress bar. argv: <backup dir>. Prints `SCRIPT: done` once
per worker at the end (the script's own output).
"""

import sys

import keras_replicator as kr

replicator = kr.auto()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8, 8, 1)).astype("float32")
y = rng.integers(0, 3, 256)
with replicator.scope():
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3),
            keras.layers.BatchNormalization(),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
model.fit(
    dataset,
    epochs=3,
    callbacks=[keras.callbacks.BackupAndRestore(sys.argv[1])],
)
print("SCRIPT: done", flush=True)
