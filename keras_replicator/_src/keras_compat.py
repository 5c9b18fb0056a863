"""What a multi-worker strategy must do differently for Keras 3's trainer.

Keras 3.15's TensorFlow trainer (`keras/src/backend/tensorflow/trainer.py`)
has branches for `MultiWorkerMirroredStrategy` that were never exercised and
fail (keras-team/keras#20585, tensorflow/tensorflow#72388):

1. `_maybe_symbolic_build` calls `strategy.reduce("MEAN", batch, axis=None)`
   on the whole first batch, a *nest* of `PerReplica` values.
   `MirroredStrategy` maps `reduce` over nests; MWMS does not and fails with
   "Attempt to convert a value (PerReplica...) ... to a Tensor".
2. `reduce_per_replica` reduces each step's logs with
   `strategy.reduce("MEAN", v, axis=0)`. The logs are per-replica *scalars*
   (loss and metric results), and MWMS fails with "Invalid reduction
   dimension 0 for input with 0 dimensions".

Both calls go through `Strategy.reduce` of OUR strategy object, so no Keras
code is patched: `KerasCompatMixin.reduce` maps over nests and reduces a
scalar's "axis 0" across replicas only, which is what `MirroredStrategy`'s
`reduce_mean(local_results, axis=0)` branch computes for the same logs. The
cross-replica mean of the per-replica results then matches a single-device
run whenever every replica sees the same number of examples.

`KERAS_TRAINER_CALLS` records the exact Keras source lines this relies on;
`tests/test_keras_compat.py` fails when a Keras upgrade changes them.
"""

from __future__ import annotations

import tensorflow as tf

# Source lines of keras/src/backend/tensorflow/trainer.py this module answers.
KERAS_TRAINER_CALLS = (
    "data_batch = self.distribute_strategy.reduce(",
    'return strategy.reduce("MEAN", v, axis=0)',
    'return strategy.reduce("SUM", v)',
    "return _multi_worker_concat(v, strategy)",
)


class KerasCompatMixin:
    """Makes a multi-worker strategy's `reduce` serve Keras 3's trainer.

    Put it before `tf.distribute.MultiWorkerMirroredStrategy` in the bases.
    """

    def reduce(self, reduce_op, value, axis=None):
        """Reduces `value` across every replica of every worker.

        Like `tf.distribute.Strategy.reduce`, with two extensions that Keras
        3's trainer needs: `value` may be a nest (each leaf is reduced, in
        `tf.nest.flatten` order, which is the same on every worker), and a
        scalar leaf with `axis=0` is reduced across replicas only.

        Args:
            reduce_op: `"SUM"`, `"MEAN"` or a `tf.distribute.ReduceOp`.
            value: A `tf.distribute.DistributedValues`, a tensor, or a nest
                of them.
            axis: The dimension to reduce within each replica, or `None`.

        Returns:
            A tensor, or a nest of tensors shaped like `value`.
        """
        parent = super()
        leaves = tf.nest.flatten(value, expand_composites=False)
        if len(leaves) == 1 and leaves[0] is value:
            return parent.reduce(reduce_op, value, _leaf_axis(value, axis))
        reduced = [
            parent.reduce(reduce_op, leaf, _leaf_axis(leaf, axis))
            for leaf in leaves
        ]
        return tf.nest.pack_sequence_as(value, reduced)


def _leaf_axis(value, axis):
    """`None` for a scalar value: it has no axis 0 to reduce within."""
    if axis is None:
        return None
    first = value
    if isinstance(value, tf.distribute.DistributedValues):
        first = value.values[0]
    rank = getattr(getattr(first, "shape", None), "rank", None)
    return None if rank == 0 else axis
