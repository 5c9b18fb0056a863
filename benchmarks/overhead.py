"""Overhead of LocalReplicator over a plain MirroredStrategy, same devices.

Trains the same model with `model.fit` under `kr.LocalReplicator(2)` and under
`tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])`, alternating timed
epochs, and prints steps/sec of each and the median per-pair ratio.
Goal: ratio >= 0.98 (the replicator adds no overhead).

    python benchmarks/overhead.py [--pairs 8]
"""

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras_replicator as kr  # noqa: E402

kr.configure_cpu_replicas(2)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from _common import machine  # noqa: E402
from _common import paired_ratios  # noqa: E402
from _common import summary  # noqa: E402
from _common import timed  # noqa: E402

from keras_replicator._src.cli import demo  # noqa: E402


def make_runner(strategy, x, y, batch):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = demo.build_resnet()
        model.compile(
            keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy"
        )
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # compile
    steps = len(x) // batch

    def run():
        seconds, _ = timed(
            lambda: model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        )
        return steps / seconds

    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    (x, y), _ = demo.load_digits_split()
    n = len(x) // args.batch * args.batch
    x, y = x[:n], y[:n]
    ours = make_runner(kr.LocalReplicator(2), x, y, args.batch)
    plain = make_runner(
        tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), x, y, args.batch
    )
    rates_ours, rates_plain, ratios = paired_ratios(ours, plain, args.pairs)
    print(machine())
    print(
        f"model.fit, digits ResNet, global batch {args.batch}, 2 CPU replicas"
    )
    print(
        f"LocalReplicator(2)     steps/sec median "
        f"{statistics.median(rates_ours):.1f}"
    )
    print(
        f"MirroredStrategy(2)    steps/sec median "
        f"{statistics.median(rates_plain):.1f}"
    )
    print(summary("ratio ours/plain", ratios))


if __name__ == "__main__":
    main()
