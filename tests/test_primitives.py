"""Cross-replica primitives: values on 4 local replicas, errors, Keras use."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr


@pytest.fixture(scope="module")
def replicator():
    return kr.LocalReplicator(4)


def _per_replica(replicator, fn):
    """Runs fn on every replica in a tf.function; one result per replica."""
    result = tf.function(lambda: replicator.run(fn))()
    return [
        tf.nest.map_structure(lambda t: t.numpy(), r)
        for r in _split(replicator, result)
    ]


def _split(replicator, per_replica):
    flat = tf.nest.flatten(per_replica)
    cols = [replicator.experimental_local_results(v) for v in flat]
    return [
        tf.nest.pack_sequence_as(per_replica, [c[i] for c in cols])
        for i in range(len(cols[0]))
    ]


def _rid():
    return tf.cast(kr.replica_id(), tf.float32)


def test_all_gather_of_replica_ids(replicator):
    results = _per_replica(replicator, lambda: kr.all_gather(kr.replica_id()))
    for r in results:
        np.testing.assert_array_equal(r, [0, 1, 2, 3])


def test_all_gather_concatenates_along_axis(replicator):
    def fn():
        return kr.all_gather(tf.fill([2, 1], _rid()), axis=1)

    for r in _per_replica(replicator, fn):
        np.testing.assert_array_equal(r, [[0, 1, 2, 3], [0, 1, 2, 3]])


def test_broadcast_from_replica_two(replicator):
    def fn():
        value = {"x": _rid() * 10.0 + 1.0, "flag": tf.equal(kr.replica_id(), 2)}
        return kr.broadcast(value, source_replica=2)

    for r in _per_replica(replicator, fn):
        assert r == {"x": 21.0, "flag": True}


@pytest.mark.parametrize(
    "op, expected",
    [("sum", 6.0 * 3), ("mean", 1.5 * 3), ("max", 9.0), ("min", -1.0)],
)
def test_all_reduce_ops(replicator, op, expected):
    # Replica i holds 3*i - 1 in [-1, 2, 5, 8] ... scaled to distinguish ops.
    def fn():
        return kr.all_reduce(3.0 * _rid() - (1.0 if op == "min" else 0.0), op)

    for r in _per_replica(replicator, fn):
        assert r == pytest.approx(expected)


def test_mixed_dtypes_in_one_call(replicator):
    def fn():
        return kr.all_sum({"f": _rid(), "i": kr.replica_id()})

    for r in _per_replica(replicator, fn):
        assert r == {"f": 6.0, "i": 6}


def test_named_reductions_on_nested_dicts(replicator):
    def fn():
        rid = _rid()
        value = {"a": tf.stack([rid, -rid]), "b": {"c": rid * rid}}
        return {
            "sum": kr.all_sum(value),
            "mean": kr.all_mean(value),
            "max": kr.all_max(value),
            "min": kr.all_min(value),
        }

    for r in _per_replica(replicator, fn):
        np.testing.assert_allclose(r["sum"]["a"], [6, -6])
        assert r["sum"]["b"]["c"] == 14
        np.testing.assert_allclose(r["mean"]["a"], [1.5, -1.5])
        assert r["mean"]["b"]["c"] == 3.5
        np.testing.assert_allclose(r["max"]["a"], [3, 0])
        assert r["max"]["b"]["c"] == 9
        np.testing.assert_allclose(r["min"]["a"], [0, -3])
        assert r["min"]["b"]["c"] == 0


def test_replica_id_and_num_replicas(replicator):
    results = _per_replica(
        replicator, lambda: (kr.replica_id(), tf.constant(kr.num_replicas()))
    )
    assert [tuple(r) for r in results] == [(i, 4) for i in range(4)]
    assert kr.num_replicas() == 1
    with replicator.scope():
        assert kr.num_replicas() == 4


def test_primitives_inside_a_while_loop(replicator):
    # Same structure as steps_per_call: strategy.run inside tf.while_loop.
    @tf.function
    def run():
        def body(i, total):
            out = replicator.run(lambda: kr.all_sum(_rid()))
            return i + 1, total + replicator.reduce("MEAN", out, axis=None)

        return tf.while_loop(lambda i, _: i < 3, body, (0, 0.0))[1]

    assert float(run()) == 18.0


def test_all_sum_is_differentiable(replicator):
    def fn():
        x = tf.constant(2.0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = kr.all_sum(x * (_rid() + 1.0))
        return tape.gradient(y, x)

    # The gradient of an all-sum is an all-sum of the upstream gradients
    # (1 on each of 4 replicas), times replica i's own factor (i + 1).
    for i, r in enumerate(_per_replica(replicator, fn)):
        assert r == pytest.approx(4.0 * (i + 1))


def test_without_a_strategy_there_is_one_replica():
    assert float(kr.all_sum(3.0)) == 3.0
    assert float(kr.all_max(3.0)) == 3.0
    np.testing.assert_array_equal(kr.all_gather(tf.constant(5)), [5])
    assert float(kr.broadcast(4.0)) == 4.0
    assert int(kr.replica_id()) == 0


def test_unknown_op_is_named():
    with pytest.raises(ValueError, match=r"Received: op='prod'"):
        kr.all_reduce(tf.ones([]), op="prod")


def test_bad_source_replica_is_named(replicator):
    with pytest.raises(ValueError, match="Received: source_replica=4"):
        replicator.run(tf.function(lambda: kr.broadcast(1.0, 4)))


@pytest.mark.parametrize(
    "name, call",
    [
        ("all_reduce", lambda: kr.all_reduce(1.0)),
        ("all_sum", lambda: kr.all_sum(1.0)),
        ("all_mean", lambda: kr.all_mean(1.0)),
        ("all_max", lambda: kr.all_max(1.0)),
        ("all_min", lambda: kr.all_min(1.0)),
        ("all_gather", lambda: kr.all_gather(tf.ones([1]))),
        ("broadcast", lambda: kr.broadcast(1.0)),
        ("replica_id", lambda: kr.replica_id()),
    ],
)
def test_cross_replica_context_says_where_to_call(replicator, name, call):
    with replicator.scope():
        with pytest.raises(RuntimeError, match=rf"`{name}`.*strategy.run"):
            call()


class _CenterAcrossReplicas(keras.layers.Layer):
    """Subtracts the global batch mean: needs all_mean inside `call`."""

    def call(self, x):
        return x - kr.all_mean(tf.reduce_mean(x, axis=0))


def test_inside_a_keras_layer_under_fit(replicator):
    # Keras traces `call` symbolically under scope (cross-replica context);
    # the primitives act locally there, then reduce for real under fit.
    x = np.arange(32, dtype="float32").reshape(16, 2)
    with replicator.scope():
        model = keras.Sequential(
            [
                keras.Input((2,)),
                _CenterAcrossReplicas(),
                keras.layers.Dense(2, kernel_initializer="identity"),
            ]
        )
        model.compile("sgd", "mse")
    # Each replica sees 4 rows; only the global mean centers the batch.
    out = model.predict(x, batch_size=16, verbose=0)
    np.testing.assert_allclose(out, x - x.mean(axis=0), atol=1e-5)
    history = model.fit(x, x - x.mean(axis=0), batch_size=16, verbose=0)
    assert history.history["loss"][0] == pytest.approx(0.0, abs=1e-6)
