"""Large variables' optimizer updates, compiled: one device's numbers.

Under `ModelParallel` each device updates its own blocks of the sharded
variables, under DataParallel its own copy of each replicated one; a block
or variable of at least `compiled_updates.MIN_ELEMENTS` values is updated
by the optimizer's own `update_step` in a function XLA compiles
(`patches/compiled_updates.py`). Checked here on a 1x4 mesh whose two
large kernels have blocks of 65536 values, and on 4 DataParallel devices:
which updates are compiled (the large ones only, on every device), and that
weights, optimizer state and logs equal those of Keras' own ops on the same
devices (float32 to 1e-6, float64 to 1e-12) and one device's, for Adam,
AdamW and SGD with momentum. One device and the user's own `strategy.run`
keep Keras' ops.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.core import placements
from keras_replicator._src.patches import compiled_updates
from tests import helpers

# Against Keras' own ops on the same mesh: the same formula, where XLA may
# fuse a multiply and an add (one rounding). Against one device: as any
# ModelParallel step (its products sum in another order; Adam magnifies
# last-bit differences of small gradients).
TOL = {"float32": 1e-6, "float64": 1e-12}
ONE_DEVICE_TOL = {"float32": 5e-5, "float64": 1e-10}


class OwnAdam(keras.optimizers.Adam):
    """An `update_step` of the user's own: kept as written, not compiled."""

    def update_step(self, gradient, variable, learning_rate):
        return super().update_step(gradient, variable, learning_rate)


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "own_adam": lambda: OwnAdam(1e-3),
    "accumulation": lambda: keras.optimizers.Adam(
        1e-3, gradient_accumulation_steps=2
    ),
    "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}

# Blocks on a 1x4 mesh: a and b 512 x 128 (65536 values: compiled), c
# 128 x 4 (512: Keras' ops). Biases are replicated.
_LAYOUTS = {
    ".*/a/kernel": (None, "model"),
    ".*/b/kernel": ("model", None),
    ".*/c/kernel": ("model", None),
}


@pytest.fixture(autouse=True)
def no_distribution():
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


def _model(name):
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [
            keras.Input((512,)),
            keras.layers.Dense(512, activation="tanh", name="a"),
            keras.layers.Dense(512, activation="tanh", name="b"),
            keras.layers.Dense(4, name="c"),
        ]
    )
    model.compile(optimizer=OPTIMIZERS[name](), loss="mse", metrics=["mae"])
    return model


def _data():
    rng = np.random.default_rng(4)
    return rng.normal(size=(48, 512)), rng.normal(size=(48, 4))


def _fit(name, floatx):
    with helpers.floatx(floatx):
        model = _model(name)
        x, y = _data()
        history = model.fit(
            x, y, batch_size=16, epochs=2, verbose=0, shuffle=False
        )
    return model, history.history


@functools.cache
def _reference(name, floatx):
    keras.distribution.set_distribution(None)
    return _fit(name, floatx)


def _same(reference, h0, model, h1, tol):
    assert h0.keys() == h1.keys()
    for key in h0:
        _close(h0[key], h1[key], tol)
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        _close(a, b, tol)
    for a, b in zip(
        reference.optimizer.variables, model.optimizer.variables, strict=True
    ):
        _close(a.numpy(), b.numpy(), tol)


def _close(a, b, tol):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(float(np.max(np.abs(a))), 1e-6)
    assert float(np.max(np.abs(a - b))) <= tol * scale, (
        float(np.max(np.abs(a - b))),
        scale,
    )


def _matches_keras_ops_and_one_device(
    name, floatx, monkeypatch, model, h1, reference
):
    """The same fit with Keras' ops for every update, and one device's."""
    monkeypatch.setattr(compiled_updates, "MIN_ELEMENTS", 1 << 40)
    stock, h2 = _fit(name, floatx)
    with helpers.floatx(floatx):
        assert _compiled_calls(stock) == []
    _same(stock, h2, model, h1, TOL[floatx])
    _same(*reference, model, h1, ONE_DEVICE_TOL[floatx])


def _compiled_calls(model):
    """The compiled functions one traced train step calls: their devices.

    Also those called in a branch of a `tf.cond` (gradient accumulation
    updates in one), which live in the graph's function library.
    """
    strategy = model.distribute_strategy

    @tf.function
    def step(x, y):
        return strategy.run(model.train_step, args=((x, y),))

    dtype = model.compute_dtype
    return _xla_calls(
        step.get_concrete_function(
            tf.TensorSpec([4, 512], dtype), tf.TensorSpec([4, 4], dtype)
        )
    )


def _xla_calls(concrete):
    """The devices of a traced function's compiled calls, branches included."""
    graph_def = concrete.graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return [
        node.device
        for node in nodes
        if "PartitionedCall" in node.op and node.attr["_XlaMustCompile"].b
    ]


@pytest.mark.parametrize(
    "name, floatx",
    [
        ("adam", "float32"),
        ("adam", "float64"),
        ("adamw", "float32"),
        ("sgd_momentum", "float32"),
        ("own_adam", "float32"),
        ("accumulation", "float32"),
    ],
)
def test_large_blocks_update_compiled_with_one_devices_numbers(
    name, floatx, monkeypatch
):
    one_device, h0 = _reference(name, floatx)
    distribution = helpers.model_parallel((1, 4), _LAYOUTS)
    keras.distribution.set_distribution(distribution)
    model, h1 = _fit(name, floatx)
    for layer in ("a", "b", "c"):
        assert placements.of(model.get_layer(layer).kernel) is not None
    block = model.get_layer("a").kernel.shape.num_elements() // 4
    assert block == compiled_updates.MIN_ELEMENTS
    # Where the updates ran: a's and b's blocks compiled on each of the 4
    # devices; c's small blocks and the biases by Keras' ops.
    with helpers.floatx(floatx):
        calls = _compiled_calls(model)
    if name == "own_adam":
        assert calls == []
    else:
        assert len(calls) == 2 * 4, calls
        if name != "accumulation":  # In a branch: placed when it runs.
            assert len(set(calls)) == 4, calls
    # The same mesh with Keras' ops for every update.
    _matches_keras_ops_and_one_device(
        name, floatx, monkeypatch, model, h1, (one_device, h0)
    )


@pytest.mark.parametrize(
    "name, floatx",
    [("adam", "float32"), ("adam", "float64"), ("accumulation", "float32")],
)
def test_data_parallel_updates_its_large_variables_compiled(
    name, floatx, monkeypatch
):
    # Each replica updates its own copy of a and b's kernels (262144 values)
    # compiled, from the averaged gradients; c's and the biases by Keras'
    # ops. One device's numbers, as with Keras' ops everywhere.
    one_device, h0 = _reference(name, floatx)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()[:4]
        )
    )
    model, h1 = _fit(name, floatx)
    with helpers.floatx(floatx):
        calls = _compiled_calls(model)
    assert len(calls) == 2 * 4, calls
    if name != "accumulation":  # In a branch: placed when it runs.
        assert len(set(calls)) == 4, calls
    _matches_keras_ops_and_one_device(
        name, floatx, monkeypatch, model, h1, (one_device, h0)
    )


def test_one_devices_and_the_users_own_updates_are_keras_own():
    # No replicator: Keras' ops. The user's own `strategy.run`
    # (tf.distribute's convention, a cross-replica update): Keras' ops.
    x, y = _data()
    model = _model("adam")
    model.fit(x[:16], y[:16], batch_size=16, verbose=0)
    assert _compiled_calls(model) == []
    replicator = kr.LocalReplicator(num_replicas=2)
    with replicator.scope():
        model = _model("adam")
    model.fit(x[:16], y[:16], batch_size=16, verbose=0)

    @tf.function
    def own_step(x, y):
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2) / 2
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(
                zip(grads, model.trainable_variables, strict=True)
            )

        replicator.run(step, args=(x, y))

    concrete = own_step.get_concrete_function(
        tf.TensorSpec([4, 512], tf.float32), tf.TensorSpec([4, 4], tf.float32)
    )
    assert _xla_calls(concrete) == []
