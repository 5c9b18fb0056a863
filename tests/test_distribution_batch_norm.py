"""Batch statistics under `keras.distribution` are the global batch's.

On JAX one program runs over the whole mesh, so `BatchNormalization` under
`DataParallel` or `ModelParallel` normalizes over the global batch and a
conv net trains to one device's weights and moving statistics. The same
here: a conv net with BN, fit on 4 devices under `DataParallel(4)` and
under `ModelParallel` with FSDP-style layouts (kernels split by output
channel), equals one device (1e-4). A plain `LocalReplicator` keeps
tf.distribute's per-replica statistics: it equals stock
`MirroredStrategy` on the same devices, and both differ from one device.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr


@pytest.fixture(autouse=True)
def no_distribution():
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


def _data():
    rng = np.random.default_rng(0)
    # Replica slices of different statistics: per-replica BN moves away.
    x = rng.normal(size=(64, 6, 6, 3)).astype("float32")
    x += np.repeat(np.arange(4), 16)[:, None, None, None].astype("float32")
    y = rng.normal(size=(64, 4)).astype("float32")
    return x, y


def _train(scope=None):
    keras.utils.set_random_seed(2)
    with scope or _nothing():
        model = keras.Sequential(
            [
                keras.Input((6, 6, 3)),
                keras.layers.Conv2D(8, 3, name="conv"),
                keras.layers.BatchNormalization(name="bn"),
                keras.layers.ReLU(),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(4, name="head"),
            ]
        )
        model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = _data()
    model.fit(x, y, batch_size=64 // 2, epochs=2, shuffle=False, verbose=0)
    return [np.array(w) for w in model.get_weights()]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *args):
        return False


def _close(a, b, rtol):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol)


def _far(a, b):
    return max(
        float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12))
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def one_device():
    keras.distribution.set_distribution(None)
    return _train()


def test_data_parallel_normalizes_over_the_global_batch(one_device):
    devices = keras.distribution.list_devices()[:4]
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices)
    )
    _close(_train(), one_device, 1e-4)


def test_model_parallel_fsdp_layouts_normalize_over_the_global_batch(
    one_device,
):
    devices = keras.distribution.list_devices()[:4]
    mesh = keras.distribution.DeviceMesh((1, 4), ("batch", "model"), devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*conv/kernel"] = (None, None, None, "model")
    layout_map[".*head/kernel"] = ("model", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    _close(_train(), one_device, 1e-4)


def test_a_plain_replicator_keeps_per_replica_statistics_as_stock(
    one_device,
):
    ours = _train(kr.LocalReplicator(4).scope())
    devices = [f"/cpu:{i}" for i in range(4)]
    stock = _train(tf.distribute.MirroredStrategy(devices).scope())
    _close(ours, stock, 1e-5)
    # Per-replica statistics of slices that differ: not one device's.
    assert _far(ours, one_device) > 1e-2
