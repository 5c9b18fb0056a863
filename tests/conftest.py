"""Shared test set-up: logical CPU devices, configured once, before TF starts.

Every test that needs several CPU replicas gets them from here. Multi-worker
tests start real subprocesses, which configure their own devices.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The most replicas any in-process test uses.
MAX_TEST_REPLICAS = 4


def pytest_configure(config):
    if getattr(config, "workerinput", None) is None and (
        config.getoption("numprocesses", default=None)
    ):
        # The pytest-xdist controller runs no tests: no TensorFlow here.
        return
    import keras_replicator as kr

    # Must run before any test module touches TensorFlow's devices.
    kr.configure_cpu_replicas(MAX_TEST_REPLICAS)


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
