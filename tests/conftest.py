"""Shared test set-up: logical devices, configured once, before TF starts.

Every test that needs several CPU replicas gets them from here, and on a
host with a GPU, tests/test_gpu.py gets its logical GPUs from here too.
Multi-worker tests start real subprocesses, which configure their own
devices.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The most replicas any in-process test uses.
MAX_TEST_REPLICAS = 4
# On a GPU host, each test process's logical GPUs: a memory limit each, so
# two pytest-xdist processes share a GPU, and tests/test_gpu.py can size a
# model that one GPU's share cannot hold.
GPU_MEMORY_LIMIT_MB = 1024


def pytest_configure(config):
    if getattr(config, "workerinput", None) is None and (
        config.getoption("numprocesses", default=None)
    ):
        # The pytest-xdist controller runs no tests: no TensorFlow here.
        return
    import keras_replicator as kr

    # Must run before any test module touches TensorFlow's devices.
    kr.configure_cpu_replicas(MAX_TEST_REPLICAS)
    _configure_gpus()


def _configure_gpus():
    """Splits one GPU into two logical GPUs; several stay one each.

    Like the CPU split, before TensorFlow starts. One GPU then holds two
    replicas (their all-reduces run TensorFlow's RING, not NCCL, which
    needs a physical GPU per replica); with several GPUs every replica has
    its own and all-reduces over NCCL. No GPU: nothing to do.
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    per_gpu = 2 if len(gpus) == 1 else 1
    for gpu in gpus:
        tf.config.set_logical_device_configuration(
            gpu,
            [
                tf.config.LogicalDeviceConfiguration(
                    memory_limit=GPU_MEMORY_LIMIT_MB
                )
            ]
            * per_gpu,
        )


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def restore_patches():
    """Puts back whichever patches were installed before the test."""
    from keras_replicator._src.patches import registry

    before = registry.installed()
    yield registry
    registry.uninstall_all()
    registry.install(before)


@pytest.fixture(autouse=True)
def _stock_strategies_take_fresh_collective_keys(monkeypatch):
    """Each test's stock strategies number their collective groups apart.

    Every stock `MirroredStrategy` (and `MultiWorkerMirroredStrategy`) in a
    process numbers its collective groups from 1 (`_collective_key_base`,
    "only set this in tests") and its instances from 100, and TensorFlow's
    collective runtime remembers an instance's shape: a second stock
    strategy over the same devices whose first collective has another
    shape fails ("Shape mismatch in the collective instance 100 ... Restart
    your program to reset"), and so does every collective after it in the
    process. Stock TensorFlow and Keras alone do this (two `fit`s of
    different models under two `MirroredStrategy(["CPU:0", "CPU:1"])`); in
    CI, test_patches' stock-paths test (19 parameters) and a later stock
    comparison (2 parameters) met in one pytest-xdist worker. Our
    replicators take their own key blocks (`replicators/base.py`, instance
    attributes); stock ones get a fresh block per test here.
    """
    import tensorflow as tf

    from keras_replicator._src.replicators import base

    for stock in (
        tf.distribute.MirroredStrategy,
        # In one process (a worker's stock strategy runs in its own).
        tf.distribute.MultiWorkerMirroredStrategy,
    ):
        monkeypatch.setattr(
            stock, "_collective_key_base", base.next_collective_key_base()
        )
