"""Single-device Keras code gives one device's numbers under replicators.

Each row of `tests/drop_in_cases.py` (optimizer options, weights, custom
steps, a GAN) trains on 2 and 4 local replicas and must end with one
device's weights (1e-5; bf16/f16 within their precision) and History
(1e-5 relative). `tests/multi_worker/test_drop_in.py` runs the same rows on
2 workers x 2 replicas. Models under no strategy and under stock
`tf.distribute` strategies keep stock Keras numbers exactly.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.patches import registry
from tests import drop_in_cases as cases
from tests import helpers


@functools.cache
def _one_device(name):
    return cases.run(name)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("name", sorted(cases.ROWS))
def test_row_matches_one_device(name, replicas):
    actual = cases.run(name, kr.LocalReplicator(replicas))
    cases.assert_same(actual, _one_device(name), name)


# Rows whose numbers stock Keras changes under a strategy (clipping, a
# custom step's logs, the ragged batch) or that go through every patched
# function (the loss-scale optimizer).
_STOCK_ROWS = (
    "clipnorm",
    "custom_train_step",
    "uneven_last_batch",
    "loss_scale_optimizer_float16",
)


@pytest.mark.parametrize("name", _STOCK_ROWS)
def test_no_strategy_and_stock_strategies_keep_stock_numbers(
    name, restore_patches
):
    kr.LocalReplicator(2)  # installs every patch of its kind
    assert registry.installed("replica_mean")
    patched = [cases.run(name), cases.run(name, helpers.stock_mirrored())]
    restore_patches.uninstall_all()
    stock = [cases.run(name), cases.run(name, helpers.stock_mirrored())]
    for got, expected in zip(patched, stock, strict=True):
        assert got == expected, f"{name}: differs from stock Keras"


def test_stock_mirrored_still_divides_custom_step_logs(restore_patches):
    # The other side of the test above: stock MirroredStrategy keeps Keras'
    # convention (a custom train_step logs loss / N), our replicator does
    # not. This is the bug our replicators fix, left alone elsewhere.
    kr.LocalReplicator(2)
    one = _one_device("custom_train_step")["history"]["loss"]
    stock = cases.run("custom_train_step", helpers.stock_mirrored())
    np.testing.assert_allclose(
        stock["history"]["loss"], np.divide(one, 2), rtol=1e-5
    )


# The research API: a `keras.losses.Loss` object in `step_fn`.
FEATURES = 5


def _data(n=128):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    return x, y


def _model():
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


def _loss_object():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _opt():
    return keras.optimizers.Adam(0.01)


def one_device_loss_object(global_batch=16, steps=6):
    """Weights and losses of `steps` steps on one device."""
    x, y = _data()
    model, opt, loss_fn = _model(), _opt(), _loss_object()
    losses = []
    for k in range(steps):
        s = slice(k * global_batch, (k + 1) * global_batch)
        with tf.GradientTape() as tape:
            loss = loss_fn(y[s], model(x[s]))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return model.get_weights(), losses


def replicated_loss_object(replicator, wrap, global_batch=16, steps=6):
    """The same steps through `replicate`, with a Loss object in step_fn."""
    x, y = _data()
    with replicator.scope():
        model, opt, loss_fn = _model(), _opt(), _loss_object()
        if wrap:
            opt = replicator.wrap_optimizer(opt)

    input_fn = helpers.replica_ordered_input_fn(x, y, global_batch)

    def step_fn(batch):
        xb, yb = batch
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    step = replicator.replicate(step_fn, input_fn)
    losses = [float(step()) for _ in range(steps)]
    return model.get_weights(), losses


@pytest.mark.parametrize("wrap", [True, False], ids=["wrapped", "plain"])
def test_loss_object_in_step_fn_matches_one_device(wrap):
    weights, losses = one_device_loss_object()
    replicator = kr.LocalReplicator(4)
    actual, actual_losses = replicated_loss_object(replicator, wrap)
    for a, e in zip(actual, weights, strict=True):
        np.testing.assert_allclose(a, e, atol=1e-5, rtol=0)
    np.testing.assert_allclose(actual_losses, losses, rtol=1e-5)
