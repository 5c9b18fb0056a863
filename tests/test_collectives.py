"""collectives.py's all-to-all, on 4 CPU replicas of one process.

`all_to_all_equal` is what ModelParallel's products exchange their rows
with (`sharding/contraction.py`): replica r's `pieces[j]` must reach
replica j, as the `[r]` of what j gets back, bit for bit, in a traced step
(one `CollectiveAllToAllV2`) and eagerly (a gather, then each replica's
pieces picked), for the dtypes the products carry and those the CPU
collective does not take (carried wider).
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src import collectives

REPLICAS = 4


def _exchange(dtype, traced):
    strategy = kr.LocalReplicator(REPLICAS)

    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        r = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
        # pieces[j] = 10 * r + j: sender r, receiver j.
        pieces = 10.0 * r + tf.range(REPLICAS, dtype=tf.float32)
        pieces = tf.tile(pieces[:, None, None], [1, 2, 3])
        return collectives.all_to_all_equal(ctx, tf.cast(pieces, dtype))

    def run():
        return strategy.run(replica_fn)

    out = tf.function(run)() if traced else run()
    return [v.numpy() for v in strategy.experimental_local_results(out)]


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize(
    "dtype", [tf.float32, tf.bfloat16, tf.float16, tf.int32, tf.int8]
)
def test_each_replica_gets_what_every_replica_sent_it(dtype, traced):
    got = _exchange(dtype, traced)
    for j, received in enumerate(got):
        assert received.dtype == dtype.as_numpy_dtype
        assert received.shape == (REPLICAS, 2, 3)
        # From sender r: 10 * r + j.
        expected = (10 * np.arange(REPLICAS) + j)[:, None, None]
        np.testing.assert_array_equal(
            received.astype(np.float32), np.broadcast_to(expected, (4, 2, 3))
        )
