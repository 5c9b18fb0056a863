"""Data and weights shared by callbacks_worker.py and test_callbacks.py."""

import numpy as np

SIZES = (5, 3, 1, 0)
SHARDS = (24, 20)
WORKER_VALUES = (1.0, 3.0)


def global_bn_batch():
    rng = np.random.default_rng(0)
    return rng.normal(2.0, 3.0, size=(sum(SIZES), 3)).astype("float32")


def classification_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(sum(SHARDS), 3)).astype("float32")
    y = rng.integers(0, 3, sum(SHARDS))
    return x, y


def initial_weights():
    rng = np.random.default_rng(1)
    return [
        rng.normal(size=(3, 3)).astype("float32"),
        rng.normal(size=(3,)).astype("float32"),
    ]
