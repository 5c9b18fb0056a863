"""Data and model shared by the 2-worker sharding test and its reference."""

import contextlib
import os

import keras
import tensorflow as tf

NUM_FILES = 7
RECORDS_PER_FILE = 1000
TFDS_EXAMPLES = 100


def write_records(directory, num_files):
    """`num_files` TFRecord files of 1,000 records; each holds its id."""
    os.makedirs(directory, exist_ok=True)
    for f in range(num_files):
        path = os.path.join(directory, f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for r in range(RECORDS_PER_FILE):
                writer.write(str(f * RECORDS_PER_FILE + r).encode())


def records(directory):
    files = sorted(
        os.path.join(directory, name) for name in os.listdir(directory)
    )
    return tf.data.TFRecordDataset(files)


def ids(record):
    return tf.strings.to_number(record, tf.int64)


def parse(record):
    """(features, label) computed from the record's id."""
    f = tf.cast(ids(record), tf.float32)
    x = tf.stack(
        [tf.sin(f), tf.cos(0.37 * f), tf.sin(0.11 * f), tf.cos(0.05 * f)]
    )
    return x, tf.cast(ids(record) % 3, tf.int32)


def model():
    m = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    m.compile(
        "sgd",
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return m


@contextlib.contextmanager
def mock_tfds():
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=TFDS_EXAMPLES):
        yield


def tfds_input_fn(ctx):
    """mnist (mocked), read with the InputContext: tfds shards it."""
    import tensorflow_datasets as tfds

    ds = tfds.load(
        "mnist",
        split="train",
        read_config=tfds.ReadConfig(input_context=ctx),
        shuffle_files=False,
    )
    # The label is the id stand-in; count examples via the weights.
    return ds.map(lambda e: (tf.cast(e["label"], tf.int64) * 0 + 1, e["label"]))
