"""Cross-replica batch norm: ours (1 all-reduce/layer) vs Keras (3).

Trains the same small ResNet (20 BatchNormalization layers) with
`model.fit` on 4 CPU replicas, once with `kr.layers.CrossReplicaBatch
Normalization` and once with `keras.layers.BatchNormalization(synchronized=
True)`, alternating timed epochs, and prints steps/sec of each and the
median per-pair ratio. Goal: ratio >= 1 (ours at least as fast).

    python benchmarks/sync_bn.py [--pairs 8] [--batch 64] [--steps 20]
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras_replicator as kr  # noqa: E402

kr.configure_cpu_replicas(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _common import machine  # noqa: E402
from _common import paired_ratios  # noqa: E402
from _common import summary  # noqa: E402
from _common import timed  # noqa: E402

REPLICAS = 4
BLOCKS = 9  # 2 BN per block + stem + one per shortcut projection = 20.


def build_resnet(bn):
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    x = keras.layers.ReLU()(bn()(x))
    filters = 8
    for i in range(BLOCKS):
        stride = 2 if i in (3, 6) else 1
        if stride == 2:
            filters *= 2
        shortcut = x
        y = keras.layers.Conv2D(filters, 3, stride, padding="same")(x)
        y = keras.layers.ReLU()(bn()(y))
        y = bn()(keras.layers.Conv2D(filters, 3, padding="same")(y))
        if stride == 2:
            shortcut = keras.layers.Conv2D(filters, 1, stride)(x)
        x = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10)(x)
    return keras.Model(inputs, outputs)


def make_runner(bn, x, y, batch):
    with kr.LocalReplicator(REPLICAS).scope():
        keras.utils.set_random_seed(0)
        model = build_resnet(bn)
        model.compile(
            keras.optimizers.SGD(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    layers = sum(
        isinstance(layer, keras.layers.BatchNormalization)
        for layer in model.layers
    )
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # trace
    steps = len(x) // batch

    def run():
        seconds, _ = timed(
            lambda: model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        )
        return steps / seconds

    return run, layers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    x = rng.normal(size=(n, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 10, n)
    ours, layers = make_runner(
        kr.layers.CrossReplicaBatchNormalization, x, y, args.batch
    )
    keras_sync, _ = make_runner(
        lambda: keras.layers.BatchNormalization(synchronized=True),
        x,
        y,
        args.batch,
    )
    rates_ours, rates_keras, ratios = paired_ratios(
        ours, keras_sync, args.pairs
    )
    print(machine())
    print(
        f"model.fit, ResNet with {layers} BN layers, 16x16x3 inputs, "
        f"global batch {args.batch}, {REPLICAS} CPU replicas, "
        f"{args.steps} steps per timed epoch"
    )
    print(
        "CrossReplicaBatchNormalization       steps/sec median "
        f"{statistics.median(rates_ours):.2f}"
    )
    print(
        "BatchNormalization(synchronized)     steps/sec median "
        f"{statistics.median(rates_keras):.2f}"
    )
    print(summary("ratio ours/keras", ratios))


if __name__ == "__main__":
    main()
