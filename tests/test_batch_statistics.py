"""BatchNormalization in a replicator's `fit` is one device's, no line added.

keras.io's "Image classification from scratch" convnet (tests/
keras_io_convnet.py: five `BatchNormalization` layers, Adam), fit on 2
replicas with no callback: its first epoch's loss and weights equal one
device's (1e-5), where stock `MirroredStrategy`'s per-replica statistics
do not; `sync_batch_norm=False` keeps those, equal to stock. The same over
2 worker processes is tests/multi_worker/test_batch_statistics.py's.

The biases right before a norm have a gradient of exactly zero: they are
compared to within Adam's steps (`keras_io_convnet.ADAM_STEPS` says why).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from tests import keras_io_convnet


@pytest.fixture(scope="module")
def one_device():
    keras.distribution.set_distribution(None)
    return keras_io_convnet.train()


@pytest.fixture(scope="module")
def stock():
    """Stock MirroredStrategy on the same devices: per-replica statistics."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    return keras_io_convnet.train(strategy.scope())


@pytest.fixture(scope="module")
def zero_gradients():
    return keras_io_convnet.zero_gradient_weights()


assert_one_devices = keras_io_convnet.assert_one_devices
_far = keras_io_convnet.farthest


def test_the_zero_gradient_weights_are_the_biases_before_a_norm(
    zero_gradients,
):
    # The entry Conv2D's and each SeparableConv2D's before a norm: 8.
    assert len(zero_gradients) == 8


def test_keras_io_convnet_on_two_replicas_is_one_devices(
    one_device, zero_gradients, stock
):
    history, weights = keras_io_convnet.train(kr.LocalReplicator(2).scope())
    assert_one_devices(history, weights, one_device, zero_gradients)
    # Stock MirroredStrategy, same devices: per-replica statistics.
    _, stock_weights = stock
    assert _far(stock_weights, one_device) > 1e-3


def test_sync_batch_norm_false_keeps_per_replica_statistics(one_device, stock):
    replicator = kr.LocalReplicator(2, sync_batch_norm=False)
    history, weights = keras_io_convnet.train(replicator.scope())
    stock_history, stock_weights = stock
    np.testing.assert_allclose(history["loss"], stock_history["loss"], 1e-5)
    for a, b in zip(weights, stock_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert _far(weights, one_device) > 1e-3


def test_train_on_batch_and_test_on_batch_are_one_devices():
    x, y = next(iter(keras_io_convnet.dataset()))

    def losses(strategy):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras_io_convnet.make_model((32, 32, 3), 2, dropout=0.0)
            model.compile(keras.optimizers.SGD(0.01), "mse")
        out = [model.train_on_batch(x, y[:, None]) for _ in range(3)]
        return out + [model.test_on_batch(x, y[:, None])]

    one_device = losses(tf.distribute.get_strategy())
    ours = losses(kr.LocalReplicator(2))
    np.testing.assert_allclose(ours, one_device, rtol=1e-5)
    # Keras' `train_on_batch` gives every replica the whole batch (its
    # data is a generator, not a distributed dataset): the global moments
    # then count it once per replica, the same statistics.
    np.testing.assert_allclose(
        losses(kr.LocalReplicator(2, sync_batch_norm=False)),
        one_device,
        rtol=1e-6,
    )


def test_batch_norm_layers_stay_plain_keras(one_device):
    # Nothing is set on the layers: the class's own `_moments` decides.
    replicator = kr.LocalReplicator(2)
    with replicator.scope():
        model = keras_io_convnet.make_model((32, 32, 3), 2, dropout=0.0)
        keras_io_convnet.compile_model(model)
    model.fit(keras_io_convnet.dataset(n=32), verbose=0, shuffle=False)
    norms = [
        layer
        for layer in model._flatten_layers()
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    assert len(norms) == 8
    for layer in norms:
        assert type(layer) is keras.layers.BatchNormalization
        assert "_moments" not in vars(layer)
