"""What tf.distribute does with a variable whose per-device parts differ.

The probe behind `docs/design.md`'s "Block storage": why ModelParallel's
blocks and ZeRO-1's flat shards are stored by the project's own code
(`sharding/sharded.py`, `sharding/optimizer_shards.py`) and not by a type of
TensorFlow's. Each test pins one fact of stock TensorFlow on a stock
`MirroredStrategy`; one that starts failing on a new release means the
fact changed, and the storage may be simpler there.

1. `strategy.run` hands each replica its own component of a
   `DistributedValues` (a `PerReplica`, a `MirroredVariable`): per-device
   blocks reach the replicas as they are. This part works.
2. `strategy.reduce` only sums or averages components of one shape: it
   never concatenates blocks, and blocks of other shapes are refused.
3. `tf.train.Checkpoint` writes ONE value for a `MirroredVariable` (its
   primary component: block 0) and the reduced value of a `SyncOnRead`
   one (the sum of the shards): either way the other blocks are lost, so
   both storages own their serialization.
4. `tf.distribute`'s own `ShardedVariable` (parameter servers) splits
   axis 0 only: the (None, "model") kernels of a Megatron layout, split
   on axis 1, cannot be one.
5. A composite tensor (`tf.experimental.ExtensionType`) holds tensors,
   not variables: the blocks it is given are read into values, and a
   checkpoint of it holds nothing.
"""

import typing

import numpy as np
import pytest
import tensorflow as tf

DEVICES = ["/cpu:0", "/cpu:1"]


@pytest.fixture(scope="module")
def strategy():
    return tf.distribute.MirroredStrategy(DEVICES)


def _blocks(strategy, **kwargs):
    """A variable whose component r is block r: [0, 1] and [2, 3]."""
    with strategy.scope():
        variable = tf.Variable(np.zeros(2, np.float32), **kwargs)
    for r, component in enumerate(variable.values):
        component.assign(np.float32([2 * r, 2 * r + 1]))
    return variable


def _per_replica(strategy, shapes):
    def value_fn(context):
        r = context.replica_id_in_sync_group
        return tf.fill([shapes[r]], float(r + 1))

    return strategy.experimental_distribute_values_from_function(value_fn)


def test_run_hands_each_replica_its_own_block(strategy):
    blocks = _blocks(strategy)
    seen = strategy.run(lambda v: tf.identity(v), args=(blocks,))
    local = strategy.experimental_local_results(seen)
    np.testing.assert_array_equal(local[0], [0, 1])
    np.testing.assert_array_equal(local[1], [2, 3])


def test_reduce_sums_blocks_and_never_concatenates_them(strategy):
    equal = _per_replica(strategy, [2, 2])
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, equal, axis=None)
    np.testing.assert_array_equal(total, [3, 3])  # Not [1, 1, 2, 2].
    uneven = _per_replica(strategy, [3, 1])
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        strategy.reduce(tf.distribute.ReduceOp.SUM, uneven, axis=None)


def test_a_checkpoint_keeps_block_zero_of_a_mirrored_variable(
    strategy, tmp_path
):
    saved = _blocks(strategy)
    path = tf.train.Checkpoint(v=saved).write(str(tmp_path / "m"))
    reader = tf.train.load_checkpoint(path)
    (key,) = [k for k in reader.get_variable_to_shape_map() if "v/" in k]
    np.testing.assert_array_equal(reader.get_tensor(key), [0, 1])


def test_a_checkpoint_keeps_the_sum_of_sync_on_read_shards(strategy, tmp_path):
    saved = _blocks(
        strategy,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM,
    )
    path = tf.train.Checkpoint(v=saved).write(str(tmp_path / "s"))
    reader = tf.train.load_checkpoint(path)
    (key,) = [k for k in reader.get_variable_to_shape_map() if "v/" in k]
    np.testing.assert_array_equal(reader.get_tensor(key), [2, 4])


def test_tf_distributes_sharded_variable_splits_the_first_axis_only():
    sharded_variable = tf.__internal__.distribute.ShardedVariable
    columns = [tf.Variable(tf.zeros([4, 2])), tf.Variable(tf.zeros([4, 3]))]
    with pytest.raises(ValueError, match="same shapes except"):
        sharded_variable(columns)
    rows = sharded_variable([tf.Variable(tf.zeros([2, 4])) for _ in "ab"])
    assert rows.shape == (4, 4)


def test_a_composite_tensor_holds_values_not_variables(tmp_path):
    class Blocks(tf.experimental.ExtensionType):
        parts: typing.Tuple[tf.Tensor, ...]  # noqa: UP006 - TF wants typing

    variables = [tf.Variable([0.0, 1.0]), tf.Variable([2.0, 3.0])]
    blocks = Blocks(tuple(variables))
    assert not any(isinstance(p, tf.Variable) for p in blocks.parts)
    module = tf.Module()
    module.blocks = blocks
    path = tf.train.Checkpoint(m=module).write(str(tmp_path / "c"))
    names = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    assert not [n for n in names if "blocks" in n]
