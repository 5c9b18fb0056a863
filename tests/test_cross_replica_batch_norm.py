"""CrossReplicaBatchNormalization: global statistics, one all-reduce, fit."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.layers import cross_replica_batch_norm as crbn
from tests.helpers import assert_weights_close

CHANNELS = 3
MOMENTUM = 0.5


@pytest.fixture(scope="module")
def replicator():
    return kr.LocalReplicator(4)


def _global_batch(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(2.0, 3.0, size=(sum(sizes), CHANNELS)).astype("float32")


def _reference_step(x):
    """Single-device Keras BN over the whole batch, and d(loss)/dx."""
    bn = keras.layers.BatchNormalization(momentum=MOMENTUM)
    bn.build(x.shape)
    weights = tf.constant(np.linspace(-1, 1, CHANNELS), tf.float32)
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = bn(x, training=True)
        loss = tf.reduce_sum(y * y * weights)
    return bn, y.numpy(), tape.gradient(loss, x).numpy()


def _replicated_step(replicator, x, sizes):
    """One training call of our layer, replica i holding sizes[i] rows."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    with replicator.scope():
        bn = kr.layers.CrossReplicaBatchNormalization(momentum=MOMENTUM)
        bn.build((None, CHANNELS))
    weights = tf.constant(np.linspace(-1, 1, CHANNELS), tf.float32)

    def value_fn(ctx):
        i = ctx.replica_id_in_sync_group
        return tf.constant(x[offsets[i] : offsets[i + 1]])

    inputs = replicator.experimental_distribute_values_from_function(value_fn)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = bn(x, training=True)
            # Each replica's share of the global loss; gradients of the
            # shared statistics flow back through the all-reduce.
            loss = tf.reduce_sum(y * y * weights)
        return y, tape.gradient(loss, x)

    y, grad = replicator.run(tf.function(step), args=(inputs,))
    local = replicator.experimental_local_results
    return (
        bn,
        np.concatenate([t.numpy() for t in local(y)]),
        np.concatenate([t.numpy() for t in local(grad)]),
    )


def _per_replica(variable):
    return [v.numpy() for v in variable.value.values]


@pytest.mark.parametrize(
    "sizes", [(4, 4, 4, 4), (5, 3, 1, 0)], ids=["even", "uneven"]
)
def test_one_step_matches_single_device(replicator, sizes):
    x = _global_batch(sizes)
    ref, ref_y, ref_grad = _reference_step(x)
    bn, y, grad = _replicated_step(replicator, x, sizes)

    np.testing.assert_allclose(y, ref_y, atol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-5)
    for ours, theirs in [
        (bn.moving_mean, ref.moving_mean),
        (bn.moving_variance, ref.moving_variance),
    ]:
        replicas = _per_replica(ours)
        # Identical, bit for bit, on every replica.
        for value in replicas[1:]:
            np.testing.assert_array_equal(value, replicas[0])
        np.testing.assert_allclose(replicas[0], theirs.numpy(), atol=1e-5)


def test_one_all_reduce_per_layer_keras_issues_three(replicator):
    def collectives(layer):
        with replicator.scope():
            layer.build((None, CHANNELS))

        def replica_fn(x):
            return layer(x, training=True)

        @tf.function
        def fn(x):
            return replicator.run(replica_fn, args=(x,))

        graph = fn.get_concrete_function(
            tf.TensorSpec((8, CHANNELS), tf.float32)
        ).graph
        return sum(
            op.type.startswith("CollectiveReduce")
            for op in graph.get_operations()
        )

    assert collectives(kr.layers.CrossReplicaBatchNormalization()) == 4
    assert (
        collectives(keras.layers.BatchNormalization(synchronized=True)) == 3 * 4
    )


def test_variance_clamped_at_zero():
    # Constant inputs: S2/n - (S1/n)^2 rounds below zero in float32.
    x = tf.fill([7, 2], 12345.678)
    naive = tf.reduce_mean(x * x, 0) - tf.reduce_mean(x, 0) ** 2
    assert np.all(naive.numpy() < 0)
    _, variance = crbn.cross_replica_moments(x, [0], -1)
    assert np.all(variance.numpy() == 0.0)


def test_shift_keeps_precision_where_keras_formula_loses_it(replicator):
    rng = np.random.default_rng(1)
    x = (1e4 + rng.normal(size=(64, 1))).astype("float32")
    truth = np.var(x.astype("float64"))

    def run(shift):
        @tf.function
        def fn(x):
            return crbn.cross_replica_moments(x, [0], -1, shift=shift)

        return replicator.run(fn, args=(tf.constant(x),))

    _, var_shifted = run(tf.constant([1e4]))
    _, var_plain = run(None)
    shifted = replicator.experimental_local_results(var_shifted)[0]
    plain = replicator.experimental_local_results(var_plain)[0]
    # Every replica holds all 64 rows here: 4x the examples, same variance.
    assert abs(float(shifted[0]) - truth) < 1e-3 * truth
    # E[x^2] - E[x]^2 in float32: error of order eps * 1e8.
    assert abs(float(plain[0]) - truth) > 0.05 * truth


def test_low_precision_inputs_reduced_in_float32():
    x = tf.constant([[60000.0], [60000.0 + 64]], tf.float16)
    mean, variance = crbn.cross_replica_moments(x, [0], -1)
    assert mean.dtype == tf.float32
    np.testing.assert_allclose(variance.numpy(), [1024.0])


def test_masked_moments_match_keras(replicator):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 5, CHANNELS)).astype("float32")
    mask = rng.random((4, 5)) > 0.4
    ref = keras.layers.BatchNormalization()
    ref.build(x.shape)
    ours = kr.layers.CrossReplicaBatchNormalization()
    ours.build(x.shape)
    ref_mean, ref_var = ref._moments(tf.constant(x), tf.constant(mask))
    mean, var = ours._moments(tf.constant(x), tf.constant(mask))
    np.testing.assert_allclose(mean, ref_mean, atol=1e-5)
    np.testing.assert_allclose(var, ref_var, atol=1e-5)


def test_plain_behaviour_outside_replicator_and_at_inference():
    x = _global_batch((10,))
    ref = keras.layers.BatchNormalization(momentum=MOMENTUM)
    ours = kr.layers.CrossReplicaBatchNormalization(momentum=MOMENTUM)
    for layer in (ref, ours):
        layer.build(x.shape)
    np.testing.assert_allclose(ours(x, training=True), ref(x, training=True))
    np.testing.assert_allclose(ours.moving_mean, ref.moving_mean, atol=1e-6)
    np.testing.assert_allclose(ours(x), ref(x), atol=1e-6)


def test_config_round_trip_and_rejects_synchronized():
    layer = kr.layers.CrossReplicaBatchNormalization(momentum=0.9, axis=1)
    config = keras.saving.serialize_keras_object(layer)
    clone = keras.saving.deserialize_keras_object(config)
    assert type(clone) is kr.layers.CrossReplicaBatchNormalization
    assert (clone.momentum, clone.axis) == (0.9, 1)
    with pytest.raises(ValueError, match="Received: synchronized=True"):
        kr.layers.CrossReplicaBatchNormalization(synchronized=True)


def _bn_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((CHANNELS,)),
            keras.layers.Dense(4),
            kr.layers.CrossReplicaBatchNormalization(momentum=MOMENTUM),
            keras.layers.Dense(1),
        ]
    )


def _fit_model(strategy, x, y, steps_per_execution, learning_rate=0.05):
    initial = _bn_model().get_weights()
    with strategy.scope() if strategy else _null():
        model = _bn_model()
        model.set_weights(initial)
        model.compile(
            keras.optimizers.SGD(learning_rate),
            "mse",
            steps_per_execution=steps_per_execution,
        )
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_fit_with_steps_per_execution_matches_single_device(replicator):
    x = _global_batch((32,))
    y = x.sum(axis=1, keepdims=True)
    reference = _fit_model(None, x, y, steps_per_execution=1)
    model = _fit_model(replicator, x, y, steps_per_execution=2)
    assert_weights_close(model.get_weights(), reference.get_weights())
    replicas = _per_replica(model.layers[1].moving_variance)
    for value in replicas[1:]:
        np.testing.assert_array_equal(value, replicas[0])


def test_fit_uneven_last_batch_gives_exact_moving_statistics(replicator):
    # 34 examples, global batch 16: the last batch's 2 examples go to two
    # replicas and the other two get none. The learning rate is 0 because
    # Keras' own loss scaling (per-replica mean / replicas) is not exact for
    # an uneven batch, with or without batch norm; the statistics are ours.
    x = _global_batch((34,))
    y = x.sum(axis=1, keepdims=True)
    reference = _fit_model(None, x, y, 2, learning_rate=0.0)
    model = _fit_model(replicator, x, y, 2, learning_rate=0.0)
    assert_weights_close(model.get_weights(), reference.get_weights())


def test_fit_steps_per_execution_needs_cond_fix(replicator, restore_patches):
    # Documents the TensorFlow bug nested_collectives works around: without
    # it, any collective in a step fails under steps_per_execution > 1. When
    # this test fails, TensorFlow fixed it: remove nested_collectives.
    x = _global_batch((16,))
    restore_patches.uninstall(["nested_collectives"])
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="must feed a value"
    ):
        _fit_model(replicator, x, x[:, :1], steps_per_execution=2)
