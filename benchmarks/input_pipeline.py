"""Input throughput: the sharder versus plain experimental_distribute_dataset.

Reads the same TFRecord files (8 files x 4,000 records of 32 floats) on
`kr.LocalReplicator(2)` two ways, alternating timed epochs:

* A: `replicator.distribute(records.map(parse), 256, shuffle_seed=0,
  static_shapes=True)` (the sharder: distribute_datasets_from_function);
* B: `replicator.experimental_distribute_dataset(records.map(parse)
  .shuffle(10_000, seed=0).batch(256, drop_remainder=True))`, the plain path.

Prints examples/sec of each and the median per-pair ratio A/B.
Goal: ratio >= 1 (the sharder is no slower).

    python benchmarks/input_pipeline.py [--pairs 8]
"""

import argparse
import os
import statistics
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(__file__))

import keras_replicator as kr  # noqa: E402

kr.configure_cpu_replicas(2)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _common import machine  # noqa: E402
from _common import paired_ratios  # noqa: E402
from _common import summary  # noqa: E402
from _common import timed  # noqa: E402

FILES, RECORDS, FEATURES, BATCH = 8, 4000, 32, 256


def write_files(directory):
    rng = np.random.default_rng(0)
    paths = []
    for f in range(FILES):
        path = os.path.join(directory, f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(RECORDS):
                x = rng.normal(size=FEATURES).astype("float32")
                example = tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            "x": tf.train.Feature(
                                float_list=tf.train.FloatList(value=x)
                            ),
                            "y": tf.train.Feature(
                                int64_list=tf.train.Int64List(value=[f])
                            ),
                        }
                    )
                )
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


SPEC = {
    "x": tf.io.FixedLenFeature([FEATURES], tf.float32),
    "y": tf.io.FixedLenFeature([], tf.int64),
}


def parse(record):
    example = tf.io.parse_single_example(record, SPEC)
    return example["x"], example["y"]


def epoch_rate(replicator, dist):
    def run():
        examples = 0
        for _, y in dist:
            for part in replicator.experimental_local_results(y):
                examples += int(part.shape[0])
        return examples

    seconds, examples = timed(run)
    return examples / seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=8)
    args = parser.parse_args()
    replicator = kr.LocalReplicator(2)
    with tempfile.TemporaryDirectory() as directory:
        records = tf.data.TFRecordDataset(write_files(directory))
        ours = replicator.distribute(
            records.map(parse), BATCH, shuffle_seed=0, static_shapes=True
        )
        plain = replicator.experimental_distribute_dataset(
            records.map(parse)
            .shuffle(10_000, seed=0)
            .batch(BATCH, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE)
        )
        epoch_rate(replicator, ours)  # warm up both
        epoch_rate(replicator, plain)
        rates_a, rates_b, ratios = paired_ratios(
            lambda: epoch_rate(replicator, ours),
            lambda: epoch_rate(replicator, plain),
            args.pairs,
        )
    print(machine())
    print(
        f"kr.distribute          examples/sec median "
        f"{statistics.median(rates_a):.0f}"
    )
    print(
        f"experimental_distribute examples/sec median "
        f"{statistics.median(rates_b):.0f}"
    )
    print(summary("ratio ours/plain", ratios))


if __name__ == "__main__":
    main()
