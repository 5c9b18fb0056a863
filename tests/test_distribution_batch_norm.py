"""Batch statistics under `keras.distribution` are the global batch's.

On JAX one program runs over the whole mesh, so `BatchNormalization` under
`DataParallel` or `ModelParallel` normalizes over the global batch and a
conv net trains to one device's weights and moving statistics. The same
here: a conv net with BN, fit on 4 devices under `DataParallel(4)` and
under `ModelParallel` with FSDP-style layouts (kernels split by output
channel), equals one device (1e-4). So does a plain `LocalReplicator`'s
`fit` (`patches/batch_statistics.py`), where stock `MirroredStrategy`'s
per-replica statistics differ from one device; with
`sync_batch_norm=False`, and in the user's own `strategy.run`, ours keeps
per-replica statistics and equals stock.
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


def test_a_replicator_normalizes_over_the_global_batch_by_default(
    one_device,
):
    # No callback added: the replicator's fit is one device's, where stock
    # MirroredStrategy's per-replica statistics of slices that differ are
    # not.
    ours = _train(kr.LocalReplicator(4).scope())
    devices = [f"/cpu:{i}" for i in range(4)]
    stock = _train(tf.distribute.MirroredStrategy(devices).scope())
    _close(ours, one_device, 1e-5)
    assert _far(stock, one_device) > 1e-2


def test_sync_batch_norm_false_keeps_per_replica_statistics_as_stock(
    one_device,
):
    ours = _train(kr.LocalReplicator(4, sync_batch_norm=False).scope())
    devices = [f"/cpu:{i}" for i in range(4)]
    stock = _train(tf.distribute.MirroredStrategy(devices).scope())
    _close(ours, stock, 1e-5)
    assert _far(ours, one_device) > 1e-2


def _own_run_moments(strategy):
    """The moving mean after one training call in the user's own `run`."""
    with strategy.scope():
        layer = keras.layers.BatchNormalization(momentum=0.0)
        layer.build((None, 3))
    x, _ = _data()
    x = x[:, 0, 0, :]
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(x).batch(64)
    )

    @tf.function
    def step(batch):
        strategy.run(lambda b: layer(b, training=True), args=(batch,))

    step(next(iter(dataset)))
    return np.array(layer.moving_mean.value.values[0])


def test_the_users_own_run_keeps_per_replica_statistics_as_stock():
    # Code written for tf.distribute keeps tf.distribute's convention: each
    # replica normalizes by its own slice (replica 0's mean here).
    devices = [f"/cpu:{i}" for i in range(4)]
    ours = _own_run_moments(kr.LocalReplicator(4))
    stock = _own_run_moments(tf.distribute.MirroredStrategy(devices))
    np.testing.assert_allclose(ours, stock, rtol=1e-6)
    x, _ = _data()
    np.testing.assert_allclose(ours, x[:16, 0, 0, :].mean(0), rtol=1e-5)


def test_sync_batch_norm_must_be_a_bool():
    with pytest.raises(TypeError, match="Received: sync_batch_norm='no'"):
        kr.LocalReplicator(2, sync_batch_norm="no")
