"""Sharded optimizer state (`shard_optimizer_state=True`) equals one device.

Each case trains the same seeded model on one device and on a
`LocalReplicator` whose replicas keep 1/N of the optimizer state, and
compares the weights (1e-5). Checkpoints hold the full state and restore
across replica counts, sharded or not.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src import collectives
from keras_replicator._src.sharding import optimizer_shards
from tests import helpers

OPTIMIZERS = {
    "sgd_momentum": lambda **kw: keras.optimizers.SGD(0.05, momentum=0.9, **kw),
    "adam": lambda **kw: keras.optimizers.Adam(0.01, **kw),
    "adamw": lambda **kw: keras.optimizers.AdamW(0.01, weight_decay=0.1, **kw),
    "rmsprop": lambda **kw: keras.optimizers.RMSprop(0.01, **kw),
}

# Further element-by-element optimizers: compared with one device locally.
MORE_OPTIMIZERS = {
    "adam_amsgrad": lambda **kw: keras.optimizers.Adam(0.01, amsgrad=True),
    "adagrad": lambda **kw: keras.optimizers.Adagrad(0.05),
    "adadelta": lambda **kw: keras.optimizers.Adadelta(1.0),
    "adamax": lambda **kw: keras.optimizers.Adamax(0.01),
    "nadam": lambda **kw: keras.optimizers.Nadam(0.01),
    "ftrl": lambda **kw: keras.optimizers.Ftrl(
        0.05, l2_shrinkage_regularization_strength=0.01
    ),
    "lion": lambda **kw: keras.optimizers.Lion(0.001, weight_decay=0.1),
}


# name -> (optimizer, options): what the 2-worker test trains
# (tests/multi_worker/test_shard_state.py).
MULTI_WORKER_CASES = {
    **{name: (name, {}) for name in OPTIMIZERS},
    "adam_global_clipnorm": ("adam", {"opt": {"global_clipnorm": 0.05}}),
    "adam_accumulation": ("adam", {"opt": {"gradient_accumulation_steps": 2}}),
    "adam_steps_per_execution": ("adam", {"steps_per_execution": 3}),
    "adam_clipnorm": ("adam", {"opt": {"clipnorm": 0.05}}),
    "adam_clipvalue": ("adam", {"opt": {"clipvalue": 0.01}}),
    "adam_jit_compile": ("adam", {"jit_compile": True}),
    "adam_small_buckets": ("adam", {"bucket_bytes": 32}),
}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    return x, y


def _model(
    strategy, optimizer_fn, opt=None, kernel_constraint=None, **compile_kwargs
):
    keras.utils.set_random_seed(1)
    scope = strategy.scope() if strategy else tf.device("CPU:0")
    with scope:
        optimizer = optimizer_fn(**(opt or {}))
        # 7 units: sizes 56, 7, 21 and 3 do not divide by 2 or 4, so the
        # last shard is padded.
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(
                    7, activation="relu", kernel_constraint=kernel_constraint
                ),
                keras.layers.Dense(3),
            ]
        )
        model.compile(optimizer, "mse", **compile_kwargs)
    return model


@contextlib.contextmanager
def _bucket_bytes(value):
    """Sharded collectives in buckets of `value` bytes (None: the default)."""
    saved = optimizer_shards.BUCKET_BYTES
    if value is not None:
        optimizer_shards.BUCKET_BYTES = value
    try:
        yield
    finally:
        optimizer_shards.BUCKET_BYTES = saved


def _train(
    strategy, optimizer_fn, epochs=2, callbacks=(), bucket_bytes=None, **kwargs
):
    x, y = _data()
    with _bucket_bytes(bucket_bytes):
        model = _model(strategy, optimizer_fn, **kwargs)
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=list(callbacks),
        )
    return model


def _sharded(n):
    return kr.LocalReplicator(n, shard_optimizer_state=True)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_equals_one_device(name, replicas):
    reference = _train(None, OPTIMIZERS[name])
    model = _train(_sharded(replicas), OPTIMIZERS[name])
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


@pytest.mark.parametrize("name", sorted(MORE_OPTIMIZERS))
def test_more_optimizers_equal_one_device(name):
    # 4 replicas: every variable's last shard is padded.
    reference = _train(None, MORE_OPTIMIZERS[name])
    model = _train(_sharded(4), MORE_OPTIMIZERS[name])
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


@pytest.mark.parametrize(
    "options",
    [
        # A constraint acts on the whole gathered weight, not a shard: the
        # max-norm of a column spans every replica's shard.
        {"kernel_constraint": keras.constraints.MaxNorm(0.3)},
        # The model fits one 4 MiB bucket; 32 bytes makes several: on 4
        # replicas the kernel's 56-byte shard is gathered alone, the next
        # two shards (8 + 24 bytes) together, and every gradient alone.
        {"bucket_bytes": 32},
        {"opt": {"clipnorm": 0.05}},
        {"opt": {"global_clipnorm": 0.05}},
        {"opt": {"clipvalue": 0.01}},
        {"opt": {"gradient_accumulation_steps": 2}},
        {"steps_per_execution": 3},
        {"jit_compile": True},
    ],
    ids=[
        "max_norm_constraint",
        "small_buckets",
        "clipnorm",
        "global_clipnorm",
        "clipvalue",
        "gradient_accumulation",
        "steps_per_execution",
        "jit_compile",
    ],
)
@pytest.mark.parametrize("replicas", [2, 4])
def test_sharded_options_equal_one_device(options, replicas):
    reference = _train(None, OPTIMIZERS["adam"], **dict(options))
    model = _train(_sharded(replicas), OPTIMIZERS["adam"], **dict(options))
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_sharded_state_is_one_nth_per_replica():
    model = _train(_sharded(4), OPTIMIZERS["adam"], epochs=1)
    kernel = model.optimizer.variables[2]  # Adam's first slot: 8 x 7.
    components = kernel.value.values
    assert [tuple(c.shape) for c in components] == [(14,)] * 4


def test_default_is_unsharded():
    assert not kr.LocalReplicator(2).shard_optimizer_state
    model = _train(kr.LocalReplicator(2), OPTIMIZERS["adam"], epochs=1)
    assert tuple(model.optimizer.variables[2].shape) == (8, 7)


def test_checkpoint_holds_full_state(tmp_path):
    reference = _train(None, OPTIMIZERS["adam"], epochs=1)
    model = _train(_sharded(4), OPTIMIZERS["adam"], epochs=1)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    restored = _model(None, OPTIMIZERS["adam"])
    restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(path)
    helpers.assert_weights_close(
        [v.numpy() for v in restored.optimizer.variables],
        [v.numpy() for v in reference.optimizer.variables],
    )


def test_save_and_load_trace_nothing_again(tmp_path):
    model = _train(_sharded(4), OPTIMIZERS["adam"], epochs=1)
    path = str(tmp_path / "m.weights.h5")

    def one_round():
        model.save_weights(path)
        model.load_weights(path)
        return helpers.tf_functions_started()

    first = one_round()
    assert one_round() == first
    assert one_round() == first


@pytest.mark.parametrize(
    "first, second",
    [((4, True), (2, False)), ((2, False), (4, True))],
    ids=["sharded4_to_unsharded2", "unsharded2_to_sharded4"],
)
def test_backup_restores_across_replica_counts(tmp_path, first, second):
    reference = _train(None, OPTIMIZERS["adam"], epochs=2)

    def replicator(spec):
        return kr.LocalReplicator(spec[0], shard_optimizer_state=spec[1])

    backup = keras.callbacks.BackupAndRestore(
        str(tmp_path), delete_checkpoint=False
    )
    _train(replicator(first), OPTIMIZERS["adam"], epochs=1, callbacks=[backup])
    backup = keras.callbacks.BackupAndRestore(
        str(tmp_path), delete_checkpoint=False
    )
    model = _train(
        replicator(second), OPTIMIZERS["adam"], epochs=2, callbacks=[backup]
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


@pytest.mark.parametrize(
    "optimizer_fn, received",
    [
        (lambda **kw: keras.optimizers.Adafactor(), "optimizer=Adafactor"),
        (lambda **kw: keras.optimizers.Lamb(), "optimizer=Lamb"),
        (
            lambda **kw: keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD()
            ),
            "optimizer=LossScaleOptimizer",
        ),
        (lambda **kw: keras.optimizers.Adam(use_ema=True), "use_ema=True"),
        (
            lambda **kw: keras.optimizers.Adam(loss_scale_factor=2.0),
            "loss_scale_factor=2.0",
        ),
    ],
    ids=["adafactor", "lamb", "loss_scale", "ema", "loss_scale_factor"],
)
def test_refuses_unsupported(optimizer_fn, received):
    with pytest.raises(ValueError, match=f"Received: {received}"):
        _train(_sharded(2), optimizer_fn, epochs=1)


def test_rejects_non_bool_flag():
    with pytest.raises(TypeError, match="Received: shard_optimizer_state=1"):
        kr.LocalReplicator(2, shard_optimizer_state=1)


def test_one_replica_is_unsharded():
    reference = _train(None, OPTIMIZERS["adam"])
    model = _train(_sharded(1), OPTIMIZERS["adam"])
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_refuses_own_strategy_run():
    strategy = _sharded(2)
    model = _model(strategy, OPTIMIZERS["adam"])
    model.optimizer.build(model.trainable_variables)
    x, _ = _data()

    @tf.function
    def step():
        def replica_fn():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x[:8]))
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply(grads, model.trainable_variables)

        strategy.run(replica_fn)

    with pytest.raises(ValueError, match="Received: optimizer=Adam"):
        step()


class CustomStepModel(keras.Sequential):
    """A hand-written `train_step`, as on one device."""

    def train_step(self, data):
        x, y = data[:2]
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def _custom_step_model(strategy):
    keras.utils.set_random_seed(1)
    scope = strategy.scope() if strategy else tf.device("CPU:0")
    with scope:
        model = CustomStepModel(
            [
                keras.Input((8,)),
                keras.layers.Dense(7, activation="relu"),
                keras.layers.Dense(3),
            ]
        )
        model.compile(OPTIMIZERS["adam"](), "mse")
    return model


def test_custom_train_step_and_train_on_batch_equal_one_device():
    x, y = _data()
    models = [_custom_step_model(s) for s in (None, _sharded(4))]
    for model in models:
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        model.train_on_batch(x[:16], y[:16])
    helpers.assert_weights_close(
        models[1].get_weights(), models[0].get_weights()
    )


def test_replicate_step_equals_one_device():
    x, y = _data()
    reference = _model(None, OPTIMIZERS["adam"])
    replicator = _sharded(4)
    model = _model(replicator, OPTIMIZERS["adam"])
    with pytest.raises(RuntimeError, match="optimizer.build"):
        replicator.run(
            tf.function(
                lambda: model.optimizer.build(model.trainable_variables)
            )
        )
    # Variables are made before the step, as `replicate` asks.
    with replicator.scope():
        model.optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()

    def step_fn(batch):
        features, targets = batch
        with tf.GradientTape() as tape:
            loss = loss_fn(targets, model(features, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply(grads, model.trainable_variables)
        return loss

    step = replicator.replicate(
        step_fn, helpers.replica_ordered_input_fn(x, y, 16)
    )
    for _ in range(4):
        step()
    reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


@pytest.mark.parametrize(
    "sizes, expected",
    [
        # Kernels (large) alone; biases (small) packed between them.
        ([8, 1, 16, 1, 8, 1], [[0], [1], [2], [3], [4], [5]]),
        ([1, 1, 8, 1, 1, 1], [[0, 1], [2], [3, 4, 5]]),
        ([3, 3, 3], [[0], [1], [2]]),
        ([2, 2, 1, 4], [[0, 1], [2], [3]]),
        ([], []),
    ],
)
def test_buckets_keep_large_values_alone(sizes, expected):
    assert collectives.buckets(sizes, 4) == expected


class _Scale(keras.layers.Layer):
    """A trainable weight created with an aggregation, as some layers do."""

    def __init__(self, aggregation, **kwargs):
        super().__init__(**kwargs)
        self.aggregation = aggregation

    def build(self, input_shape):
        self.w = self.add_weight(
            shape=(input_shape[-1],),
            initializer="ones",
            aggregation=self.aggregation,
        )

    def call(self, x):
        return x * self.w


@pytest.mark.parametrize("aggregation", ["sum", "mean"])
def test_weight_with_aggregation_equals_one_device(aggregation):
    # Each replica assigns its own gathered copy: a "sum" weight is not
    # summed over the replicas.
    x, y = _data()

    def train(strategy):
        keras.utils.set_random_seed(1)
        with strategy.scope() if strategy else tf.device("CPU:0"):
            model = keras.Sequential(
                [keras.Input((8,)), _Scale(aggregation), keras.layers.Dense(3)]
            )
            model.compile(OPTIMIZERS["adam"](), "mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model

    helpers.assert_weights_close(
        train(_sharded(2)).get_weights(), train(None).get_weights()
    )
