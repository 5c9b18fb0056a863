"""replicator.replicate: input_fn/step_fn, reductions, steps_per_call."""

import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr


@pytest.fixture(scope="module")
def replicator():
    return kr.LocalReplicator(4)


def _range_input_fn(ctx):
    # Per-replica batches of 2 consecutive integers: 0,1 | 2,3 | 4,5 | ...
    assert isinstance(ctx, tf.distribute.InputContext)
    assert ctx.num_replicas_in_sync == 4
    return (
        tf.data.Dataset.range(1000)
        .map(lambda i: tf.cast(i, "float32"))
        .batch(ctx.get_per_replica_batch_size(8))
    )


def _batch_sum(batch):
    return {"sum": tf.reduce_sum(batch), "id": kr.replica_id()}


def test_reduce_none_gives_local_replicas_in_order(replicator):
    step = replicator.replicate(_batch_sum, _range_input_fn, reduce=None)
    first = step()
    assert isinstance(first, list) and len(first) == 4
    assert [int(r["id"]) for r in first] == [0, 1, 2, 3]
    # Replica i of step 0 got elements [2i, 2i + 1].
    assert [float(r["sum"]) for r in first] == [1.0, 5.0, 9.0, 13.0]
    second = step()
    assert [float(r["sum"]) for r in second] == [17.0, 21.0, 25.0, 29.0]


@pytest.mark.parametrize("reduce, expected", [("mean", 7.0), ("sum", 28.0)])
def test_reduce_over_all_replicas(replicator, reduce, expected):
    step = replicator.replicate(
        lambda b: tf.reduce_sum(b), _range_input_fn, reduce=reduce
    )
    assert float(step()) == expected


def test_default_reduce_is_mean_of_a_nest(replicator):
    step = replicator.replicate(
        lambda b: {"lo": tf.reduce_min(b), "hi": (tf.reduce_max(b),)},
        _range_input_fn,
    )
    out = step()
    assert float(out["lo"]) == np.mean([0, 2, 4, 6])
    assert float(out["hi"][0]) == np.mean([1, 3, 5, 7])


def test_steps_per_call_advances_k_steps_and_returns_the_last(replicator):
    with replicator.scope():
        counter = tf.Variable(
            0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA
        )

    def step_fn(batch):
        counter.assign_add(1.0)
        return tf.reduce_sum(batch)

    step = replicator.replicate(
        step_fn, _range_input_fn, reduce="sum", steps_per_call=3
    )
    # Third step (k = 2): elements 16..23, summed.
    assert float(step()) == sum(range(16, 24))
    assert float(counter.numpy()) == 3.0
    assert float(step()) == sum(range(40, 48))
    assert float(counter.numpy()) == 6.0


def test_steps_per_call_with_no_outputs(replicator):
    with replicator.scope():
        counter = tf.Variable(
            0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA
        )

    def step_fn(batch):
        counter.assign_add(tf.reduce_sum(batch) * 0.0 + 1.0)

    step = replicator.replicate(step_fn, _range_input_fn, steps_per_call=4)
    assert step() is None
    assert float(counter.numpy()) == 4.0


def test_rejects_a_non_callable_step_fn(replicator):
    with pytest.raises(TypeError, match="Received: step_fn=3"):
        replicator.replicate(3, _range_input_fn)


def test_rejects_an_input_fn_without_a_dataset(replicator):
    def input_fn(ctx):
        return [1, 2, 3]

    with pytest.raises(
        TypeError, match=r"input_fn\(ctx\) returned \[1, 2, 3\]"
    ):
        replicator.replicate(_batch_sum, input_fn)
    with pytest.raises(TypeError, match="Received: input_fn='data'"):
        replicator.replicate(_batch_sum, "data")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"reduce": "max"}, "Received: reduce='max'"),
        ({"steps_per_call": 0}, "Received: steps_per_call=0"),
    ],
)
def test_rejects_bad_options(replicator, kwargs, match):
    with pytest.raises(ValueError, match=match):
        replicator.replicate(_batch_sum, _range_input_fn, **kwargs)


def test_end_of_data_raises_out_of_range(replicator):
    def input_fn(ctx):
        return tf.data.Dataset.range(8).batch(2)

    step = replicator.replicate(lambda b: tf.reduce_sum(b), input_fn)
    step()
    with pytest.raises(tf.errors.OutOfRangeError):
        step()


def _counting_input_fn(ctx):
    # Any replica count: replica i of step 0 gets the batch [i].
    return tf.data.Dataset.range(1000).batch(1).repeat()


@pytest.mark.parametrize("steps_per_call", [1, 2])
@pytest.mark.parametrize("reduce", ["mean", "sum", None])
def test_none_leaves_stay_none(replicator, reduce, steps_per_call):
    step = replicator.replicate(
        lambda b: {"total": tf.reduce_sum(b), "aux": None, "pair": (None,)},
        _range_input_fn,
        reduce=reduce,
        steps_per_call=steps_per_call,
    )
    out = step()
    for nest in out if reduce is None else [out]:
        assert nest["aux"] is None and nest["pair"] == (None,)
    sums = [
        [1.0, 5.0, 9.0, 13.0],  # step 0: elements [2i, 2i + 1]
        [17.0, 21.0, 25.0, 29.0],  # step 1: elements [8 + 2i, 9 + 2i]
    ][steps_per_call - 1]
    if reduce is None:
        assert [float(r["total"]) for r in out] == sums
    else:
        expected = np.mean(sums) if reduce == "mean" else np.sum(sums)
        assert float(out["total"]) == expected


@pytest.mark.parametrize(
    "num_replicas, expected", [(1, 100.0), (4, 101.5)], ids=["one", "four"]
)
@pytest.mark.parametrize(
    "dtype, mean_dtype",
    [("int8", "float32"), ("uint16", "float32"), ("int32", "float64")],
)
def test_integer_mean_is_a_true_division_on_any_replica_count(
    num_replicas, expected, dtype, mean_dtype
):
    replicator = kr.LocalReplicator(num_replicas)

    def step_fn(batch):
        # 100 + replica id: the sum over 4 replicas (406) overflows int8.
        return tf.cast(100 + batch[0], dtype)

    mean = replicator.replicate(step_fn, _counting_input_fn)()
    assert mean.dtype == mean_dtype
    assert float(mean) == expected
    total = replicator.replicate(step_fn, _counting_input_fn, reduce="sum")()
    assert total.dtype == dtype


def test_rejects_non_numeric_outputs_for_reduction(replicator):
    step = replicator.replicate(
        lambda b: {"loss": tf.reduce_sum(b), "flag": tf.reduce_any(b > 3)},
        _range_input_fn,
        reduce="sum",
    )
    with pytest.raises(
        TypeError,
        match=r"`reduce='sum'` needs numeric outputs.*tf\.cast.*"
        r"Received: output_dtypes=\{'loss': 'float32', 'flag': 'bool'\}",
    ):
        step()
