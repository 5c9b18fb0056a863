"""CPU replicas read their batches in turns from one plain tf.data iterator.

`patches/plain_iterator.py`: the batches each replica gets, and so every
number of `fit`, are those of TF's `MultiDeviceIterator`; only the iterator
differs. Stock `MirroredStrategy` deals the reference batches.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.patches import plain_iterator
from tests import helpers


def _kind(distributed):
    (worker,) = distributed._iterators  # one input worker in-process
    return type(worker._iterator).__name__


def _batches(strategy, distributed):
    return [
        [np.asarray(v) for v in strategy.experimental_local_results(batch)]
        for batch in distributed
    ]


def _assert_same_batches(actual, expected):
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert len(got) == len(want)
        for a, e in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, e)


# 70 rows in global batches of 16: the last one (6 rows) leaves a replica
# of 4 with none.
_ROWS = np.arange(70 * 2, dtype=np.float32).reshape(70, 2)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("how", ["dataset", "function"])
def test_each_replica_gets_stock_tf_distributes_batches(replicas, how):
    devices = [f"/cpu:{i}" for i in range(replicas)]
    ours = kr.LocalReplicator(devices=devices)
    stock = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )

    def distribute(strategy):
        if how == "dataset":
            data = tf.data.Dataset.from_tensor_slices(_ROWS).batch(16)
            return strategy.experimental_distribute_dataset(data)
        return strategy.distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.from_tensor_slices(_ROWS).batch(
                ctx.get_per_replica_batch_size(16)
            )
        )

    assert _kind(iter(distribute(ours))) == "OwnedIterator"
    assert _kind(iter(distribute(stock))) == "OwnedMultiDeviceIterator"
    _assert_same_batches(
        _batches(ours, distribute(ours)), _batches(stock, distribute(stock))
    )


def test_a_loop_in_tf_function_takes_the_same_turns():
    # `for batch in dataset` inside tf.function reads optionals: the
    # replicas without a row of the last batch get empty values.
    def total(strategy):
        data = tf.data.Dataset.from_tensor_slices(_ROWS).batch(16)
        # Made eagerly: TF warns making a MultiDeviceIterator in a graph.
        iterator = iter(strategy.experimental_distribute_dataset(data))

        @tf.function
        def loop(iterator):
            sums = tf.zeros([strategy.num_replicas_in_sync])
            for batch in iterator:
                per_replica = strategy.run(
                    lambda x: (
                        tf.reduce_sum(x)
                        * tf.one_hot(
                            tf.distribute.get_replica_context().replica_id_in_sync_group,
                            strategy.num_replicas_in_sync,
                        )
                    ),
                    args=(batch,),
                )
                sums += strategy.reduce("SUM", per_replica, axis=None)
            return sums

        return loop(iterator).numpy()

    devices = [f"/cpu:{i}" for i in range(4)]
    np.testing.assert_array_equal(
        total(kr.LocalReplicator(devices=devices)),
        total(
            tf.distribute.MirroredStrategy(
                devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
            )
        ),
    )


def test_explicit_input_options_keep_tf_distributes_iterator():
    replicator = kr.LocalReplicator(2)
    data = tf.data.Dataset.from_tensor_slices(_ROWS).batch(16)
    distributed = replicator.experimental_distribute_dataset(
        data, tf.distribute.InputOptions()
    )
    assert _kind(iter(distributed)) == "OwnedMultiDeviceIterator"


def test_fit_is_bit_for_bit_the_multi_device_iterators(monkeypatch):
    x = np.random.default_rng(0).normal(size=(70, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def train():
        replicator = kr.LocalReplicator(4)
        with replicator.scope():
            model = helpers.jit_dense_model("adam", jit_compile=False)
        history = model.fit(
            x,
            y,
            batch_size=16,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(x, y),
        )
        evaluation = model.evaluate(x, y, batch_size=16, verbose=0)
        predictions = model.predict(x, batch_size=16, verbose=0)
        return history.history, evaluation, predictions, model.get_weights()

    turns = train()
    with monkeypatch.context() as patch:
        patch.setattr(
            plain_iterator.PlainInputExtended, "_kr_all_cpu", lambda self: False
        )
        stock_iterator = train()
    assert turns[0] == stock_iterator[0]
    assert turns[1] == stock_iterator[1]
    np.testing.assert_array_equal(turns[2], stock_iterator[2])
    for a, e in zip(turns[3], stock_iterator[3], strict=True):
        np.testing.assert_array_equal(a, e)
    # And one device's numbers.
    with tf.device("/cpu:0"):
        one = helpers.jit_dense_model("adam", jit_compile=False)
    reference = one.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for name, values in reference.history.items():
        helpers.assert_close(turns[0][name], values, name)
    helpers.assert_weights_close(turns[3], one.get_weights())


def test_one_model_evaluates_either_iterator_kind():
    # Keras' evaluate function, traced on a MultiDeviceIterator (explicit
    # input options, as `replicator.distribute` passes), retraces for the
    # plain one: their specs differ in the input workers.
    replicator = kr.LocalReplicator(2)
    with replicator.scope():
        model = helpers.jit_dense_model("sgd", jit_compile=False)
    x = np.random.default_rng(1).normal(size=(32, 8)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8)
    stock = replicator.experimental_distribute_dataset(
        data, tf.distribute.InputOptions()
    )
    plain = replicator.experimental_distribute_dataset(data)
    assert _kind(iter(stock)) == "OwnedMultiDeviceIterator"
    first = model.evaluate(stock, verbose=0)
    assert model.evaluate(plain, verbose=0) == first
    assert model.evaluate(stock, verbose=0) == first
