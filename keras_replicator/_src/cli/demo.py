"""`keras-replicator demo`: a small ResNet on the digits data, replicated.

Trains one model and global batch on 1 and N replicas (`model.fit` under a
`LocalReplicator`) and prints test accuracy and examples/sec side by side,
offline, on scikit-learn's bundled digits (1,797 real 8x8 images).

The rows show the same accuracy because the model computes in float64: N
replicas sum each gradient in another order (half-batch sums, then their
sum), and in float32 that rounding (about 1e-7 of a gradient, more where
terms cancel) grows over 12 epochs of Adam into weights about 1e-3 apart,
flipping a test example or two (98.61% against 98.33% at 14b6890); in
float64 it starts 1e-9 times smaller, far below any margin. Nothing else
differs: batch statistics are the global batch's
(`CrossReplicaBatchNormalization`) and the shuffle is seeded the same.
"""

from __future__ import annotations

import time

import keras
import numpy as np

from keras_replicator._src.layers.cross_replica_batch_norm import (
    CrossReplicaBatchNormalization,
)
from keras_replicator._src.replicators.local import LocalReplicator

GLOBAL_BATCH = 64
EPOCHS = 12
SEED = 0
# What the demo computes in (the module docstring says why).
DTYPE = "float64"


def load_digits_split(
    dtype: str = "float32",
) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Digits as `(n, 8, 8, 1)` images in [0, 1], split 80/20, fixed seed.

    Returns `((x_train, y_train), (x_test, y_test))`.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "The demo needs scikit-learn for its bundled digits data: "
            "pip install scikit-learn (or, in a keras-replicator checkout, "
            "pip install '.[demo]')"
        ) from e
    digits = load_digits()
    x = (digits.images / 16.0).astype(dtype)[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(SEED).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def build_resnet(
    num_classes: int = 10, width: int = 32, dtype: str = "float32"
) -> keras.Model:
    """A small ResNet-style convnet for 8x8 images, with cross-replica BN.

    `width` is every convolution's channels; `dtype` the layers' policy.
    """

    def bn():
        # Global-batch statistics with one fused all-reduce per layer (Keras'
        # synchronized BN issues three). Momentum 0.9: the epochs are short.
        return CrossReplicaBatchNormalization(momentum=0.9, dtype=dtype)

    def conv(filters, kernel, **kwargs):
        return keras.layers.Conv2D(
            filters, kernel, padding="same", dtype=dtype, **kwargs
        )

    inputs = keras.Input((8, 8, 1), dtype=dtype)
    x = conv(width, 3, use_bias=False)(inputs)
    x = keras.layers.ReLU(dtype=dtype)(bn()(x))
    for stride in (1, 2):
        shortcut = x
        y = conv(width, 3, strides=stride, use_bias=False)(x)
        y = keras.layers.ReLU(dtype=dtype)(bn()(y))
        y = conv(width, 3, use_bias=False)(y)
        y = bn()(y)
        if stride != 1:
            shortcut = conv(width, 1, strides=stride)(shortcut)
        x = keras.layers.ReLU(dtype=dtype)(
            keras.layers.Add(dtype=dtype)([y, shortcut])
        )
    x = keras.layers.GlobalAveragePooling2D(dtype=dtype)(x)
    outputs = keras.layers.Dense(
        num_classes, activation="softmax", dtype=dtype
    )(x)
    return keras.Model(inputs, outputs, name="digits_resnet")


class _Throughput(keras.callbacks.Callback):
    """Examples/sec over all epochs but the first (which compiles)."""

    def __init__(self, examples_per_epoch: int):
        super().__init__()
        self.examples_per_epoch = examples_per_epoch
        self.epoch_seconds: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_seconds.append(time.perf_counter() - self._start)

    @property
    def examples_per_sec(self) -> float:
        timed = self.epoch_seconds[1:] or self.epoch_seconds
        return self.examples_per_epoch * len(timed) / sum(timed)


def train_once(
    num_replicas: int, epochs: int = EPOCHS, verbose: int | str = "auto"
) -> dict[str, float]:
    """Trains the demo model on a `LocalReplicator` of `num_replicas`.

    `verbose` goes to `model.fit`. Returns the test `accuracy` and training
    `examples_per_sec`.
    """
    (x_train, y_train), (x_test, y_test) = load_digits_split(DTYPE)
    # Drop the ragged tail so every step has the full global batch.
    n = len(x_train) // GLOBAL_BATCH * GLOBAL_BATCH
    x_train, y_train = x_train[:n], y_train[:n]
    keras.utils.set_random_seed(SEED)
    replicator = LocalReplicator(num_replicas=num_replicas)
    with replicator.scope():
        model = build_resnet(dtype=DTYPE)
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    throughput = _Throughput(n)
    model.fit(
        x_train,
        y_train,
        batch_size=GLOBAL_BATCH,
        epochs=epochs,
        verbose=verbose,
        callbacks=[throughput],
    )
    _, accuracy = model.evaluate(x_test, y_test, batch_size=120, verbose=0)
    return {
        "accuracy": float(accuracy),
        "examples_per_sec": throughput.examples_per_sec,
    }


def run(replicas: int = 2, epochs: int = EPOCHS) -> dict[int, dict]:
    """Trains on 1 and on `replicas` replicas; prints and returns results."""
    results = {}
    for count in dict.fromkeys((1, replicas)):
        print(
            f"\n== Training on {count} replica(s), global batch "
            f"{GLOBAL_BATCH}, {epochs} epochs =="
        )
        results[count] = train_once(count, epochs=epochs)
    base = results[1]["examples_per_sec"]
    print("\nreplicas  test accuracy  examples/sec  speed-up")
    for count, r in results.items():
        print(
            f"{count:>8}  {r['accuracy']:>13.2%}  "
            f"{r['examples_per_sec']:>12.0f}  "
            f"{r['examples_per_sec'] / base:>7.2f}x"
        )
    print(
        "\nThe same model, data and global batch on every row, so the same "
        f"accuracy (the model computes in {DTYPE}: in float32 the replicas' "
        "other order of summing a gradient would round apart, and training "
        "would amplify it). On CPU replicas the speed-up depends on free "
        "cores; on GPUs it grows with the number of GPUs."
    )
    return results
