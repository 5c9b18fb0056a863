"""Dropout masks under `keras.distribution` are the global batch's.

On JAX one program runs over the whole mesh and draws the global batch's
dropout mask once, so `DataParallel` and `ModelParallel` train to one
device's weights with dropout on. The same here: an MLP with `Dropout`
(and one with a `noise_shape` that shares a mask along the features), fit
on 4 devices under `DataParallel(4)` and under `ModelParallel` (a (2, 2)
mesh), equals one device (1e-5), a partial last batch split unevenly over the
replicas (26 rows: 7, 7, 6, 6) included. A plain `LocalReplicator` keeps
tf.distribute's draws (every replica the same mask for its own slice): it
equals stock `MirroredStrategy`, and both differ from one device.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.layers import global_dropout
from tests import helpers


@pytest.fixture(autouse=True)
def no_distribution():
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


def _train(scope=None, noise_shape=None, rows=58):
    keras.utils.set_random_seed(5)
    with scope or _nothing():
        model = keras.Sequential(
            [
                keras.Input((3, 8)),
                keras.layers.Dense(16, activation="relu", name="d0"),
                keras.layers.Dropout(0.5, noise_shape=noise_shape, seed=11),
                keras.layers.Flatten(),
                keras.layers.Dense(4, name="d1"),
            ]
        )
        model.compile(keras.optimizers.SGD(0.1), "mse")
    rng = np.random.default_rng(0)
    # 58 rows at batch 32: the second batch has 26, uneven over 4 replicas.
    x = rng.normal(size=(rows, 3, 8)).astype("float32")
    y = rng.normal(size=(rows, 4)).astype("float32")
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return [np.array(w) for w in model.get_weights()], history.history["loss"]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *args):
        return False


def _close(a, b, tol=1e-5):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def _far(a, b):
    return max(
        float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12))
        for x, y in zip(a, b, strict=True)
    )


def _model_parallel():
    return helpers.model_parallel(
        (2, 2), {".*d0/kernel": (None, "model"), ".*d1/kernel": ("model", None)}
    )


def _data_parallel():
    devices = keras.distribution.list_devices()[:4]
    return keras.distribution.DataParallel(devices=devices)


@pytest.mark.parametrize("noise_shape", [None, (None, 3, 1)])
@pytest.mark.parametrize("distribution", [_data_parallel, _model_parallel])
def test_a_distribution_draws_one_devices_masks(distribution, noise_shape):
    weights, losses = _train(noise_shape=noise_shape)
    keras.distribution.set_distribution(distribution())
    # Where it ran: 4 replicas, not a silent fall-back to one device.
    assert tf.distribute.get_strategy().num_replicas_in_sync == 4
    ours, our_losses = _train(noise_shape=noise_shape)
    _close(ours, weights)
    np.testing.assert_allclose(our_losses, losses, rtol=1e-5)


def test_a_plain_replicator_draws_as_stock():
    # Even batches: stock splits an uneven one otherwise ("What is exact").
    weights, _ = _train(rows=64)
    ours, _ = _train(kr.LocalReplicator(4).scope(), rows=64)
    devices = [f"/cpu:{i}" for i in range(4)]
    stock, _ = _train(tf.distribute.MirroredStrategy(devices).scope(), rows=64)
    _close(ours, stock)
    # Every replica the same mask for its slice: not one device's draws.
    assert _far(ours, weights) > 1e-2


def test_fit_again_traces_nothing_anew():
    keras.distribution.set_distribution(_data_parallel())
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dropout(0.5), keras.layers.Dense(1)]
    )
    model.compile("sgd", "mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    model.fit(x, y, batch_size=8, verbose=0)
    traced = model.train_function
    model.fit(x, y, batch_size=8, verbose=0)
    assert model.train_function is traced
    assert not global_dropout.use_global_masks(model)  # Already there.


def test_outside_a_distribution_the_layer_draws_as_stock():
    x = np.ones((6, 5), "float32")
    stock = keras.layers.Dropout(0.5, seed=3)
    changed = keras.layers.Dropout(0.5, seed=3)
    model = keras.Sequential([keras.Input((5,)), changed])
    assert global_dropout.use_global_masks(model)
    np.testing.assert_array_equal(
        changed(x, training=True), stock(x, training=True)
    )
    # The override is an instance attribute Keras does not save.
    assert "call" in vars(changed)
    assert len(model.get_config()["layers"]) == 2


def test_infinite_inputs_dropped_are_zero_as_stock():
    keras.distribution.set_distribution(_data_parallel())
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dropout(0.5)])
    global_dropout.use_global_masks(model)
    strategy = tf.distribute.get_strategy()
    x = np.full((8, 64), np.inf, "float32")

    @tf.function
    def step(batch):
        return strategy.run(lambda b: model(b, training=True), (batch,))

    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(x)
    )
    out = np.concatenate(
        [
            np.asarray(v)
            for v in strategy.experimental_local_results(
                step(next(iter(dataset)))
            )
        ]
    )
    assert not np.isnan(out).any()
    assert set(np.unique(out)) == {0.0, np.inf}
