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

Keras reduces every log value (loss, each metric) with its own call, so a
step with k metrics would issue k + 1 small cross-worker all-reduces on top
of the gradients' one. `install` makes Keras hand the whole log dict to
`reduce` in one call for our multi-worker strategies, and `reduce` packs the
scalar leaves into ONE all-reduce (a stacked vector): same sums, same mean,
one collective latency per step instead of k + 1.

Every `fit`/`evaluate` also calls `_maybe_symbolic_build`, which pulls a
batch from a fresh distributed iterator and reduces the WHOLE batch
(`strategy.reduce("MEAN", batch)`: across workers, an all-reduce) only to
learn its shapes, even when the model, its loss, metrics and optimizer are
already built (then `_symbolic_build` does nothing with it). Under our
replicators (local and multi-worker) `install` replaces it:

- when everything is built it does nothing: one iterator and one
  batch-sized all-reduce less per `fit`/`evaluate` call (about 0.1-0.3 s
  here). Results then match one device more closely than stock Keras
  under a strategy: its extra iterator advanced a dataset that reshuffles
  each iteration by one order per call (one device never pulls such a
  batch), and dropped the pulled batch of a one-shot generator;
- otherwise it builds from this process's largest local replica batch, with
  no collective. Keras' mean of the replicas' batches fails with "Inputs to
  operation AddN ... must have the same size and shape" whenever the first
  batch has fewer examples than there are replicas (3 examples on 4
  replicas: one replica gets none), and the build needs only the shapes.

`KERAS_TRAINER_CALLS` records the exact Keras source lines this relies on;
`tests/test_keras_compat.py` fails when a Keras upgrade changes them.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer
from tensorflow.python.distribute import values as tf_values

from keras_replicator._src.replicators import base

_stock_reduce_per_replica = tf_trainer.reduce_per_replica

# Source lines of keras/src/backend/tensorflow/trainer.py this module answers.
KERAS_TRAINER_CALLS = (
    "data_batch = self.distribute_strategy.reduce(",
    'return strategy.reduce("MEAN", v, axis=0)',
    'return strategy.reduce("SUM", v)',
    "return _multi_worker_concat(v, strategy)",
    # install() replaces the module global that this call resolves.
    "outputs = reduce_per_replica(",
    # install() replaces the method fit and evaluate call before each run;
    # `_maybe_symbolic_build` below does what these lines of it do.
    "self._maybe_symbolic_build(iterator=epoch_iterator)",
    "for _, _, it in iterator:",
    "maybe_distributed_data_batch = next(it)",
    "self._symbolic_build(data_batch=data_batch)",
)
# What `Trainer._symbolic_build` (keras/src/trainers/trainer.py) checks
# before it builds anything; `_fully_built` checks the same.
KERAS_SYMBOLIC_BUILD_CHECKS = (
    "model_unbuilt = not all(layer.built for layer in self._flatten_layers())",
    "self._compile_metrics is not None",
    "and not self._compile_metrics.built",
    "self._compile_loss is not None and not self._compile_loss.built",
    "self.optimizer is not None and not self.optimizer.built",
)

_stock_maybe_symbolic_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build


class KerasCompatMixin:
    """Makes a multi-worker strategy's `reduce` serve Keras 3's trainer.

    Put it before `tf.distribute.MultiWorkerMirroredStrategy` in the bases.
    """

    def reduce(self, reduce_op, value, axis=None):
        """Reduces `value` across every replica of every worker.

        Like `tf.distribute.Strategy.reduce`, with two extensions that Keras
        3's trainer needs: `value` may be a nest (each leaf is reduced, in
        `tf.nest.flatten` order, which is the same on every worker), and a
        scalar leaf with `axis=0` is reduced across replicas only. The
        floating scalar per-replica leaves of a nest are reduced together,
        in one all-reduce per dtype.

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
        reduced = [None] * len(leaves)
        # Scalar per-replica leaves of one dtype travel in one all-reduce;
        # `sorted` keeps the packing order the same on every worker.
        # With one local replica, `run` returns plain tensors, not PerReplica.
        local = [
            _local_scalars(leaf, len(self.extended.worker_devices))
            for leaf in leaves
        ]
        groups = {}
        for i, values in enumerate(local):
            if values is not None:
                groups.setdefault(values[0].dtype, []).append(i)
        for dtype in sorted(groups, key=lambda d: d.name):
            indices = groups[dtype]
            if len(indices) == 1:
                continue
            columns = zip(*(local[i] for i in indices), strict=True)
            stacked = tf_values.PerReplica(
                tuple(_stack_on_device(column) for column in columns)
            )
            packed = parent.reduce(reduce_op, stacked, axis=None)
            for i, unpacked in zip(indices, tf.unstack(packed), strict=True):
                reduced[i] = unpacked
        for i, leaf in enumerate(leaves):
            if reduced[i] is None:
                reduced[i] = parent.reduce(
                    reduce_op, leaf, _leaf_axis(leaf, axis)
                )
        return tf.nest.pack_sequence_as(value, reduced)


def install() -> None:
    """Makes Keras reduce a step's logs in one call (idempotent).

    Replaces `reduce_per_replica` in Keras' TF trainer module. Only calls
    with one of our multi-worker strategies and a `"mean"` reduction (the
    train and test steps' logs) take the new path: the whole log structure
    goes to `KerasCompatMixin.reduce` at once, which packs it into one
    all-reduce. Every other call runs the stock function. `uninstall` puts
    the stock one back.
    """
    tf_trainer.reduce_per_replica = _packed_reduce_per_replica
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build


def uninstall() -> None:
    """Restores Keras' stock functions (idempotent)."""
    tf_trainer.reduce_per_replica = _stock_reduce_per_replica
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = (
        _stock_maybe_symbolic_build
    )


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    """Keras' method, built from a local batch under our replicators."""
    strategy = self._distribute_strategy
    if not _ours(strategy):
        return _stock_maybe_symbolic_build(
            self, iterator=iterator, data_batch=data_batch
        )
    if _fully_built(self):
        return None
    if iterator is not None:
        for _, _, it in iterator:
            data_batch = tf.nest.map_structure(_largest_local, next(it))
            break
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)
    return None


def _ours(strategy) -> bool:
    """Our synchronous replicators, whose builds this module takes over."""
    return isinstance(strategy, base.ReplicatorMixin) and isinstance(
        strategy,
        (
            tf.distribute.MirroredStrategy,
            tf.distribute.MultiWorkerMirroredStrategy,
        ),
    )


def _largest_local(leaf):
    """A distributed leaf's local value with the most examples."""
    if not isinstance(leaf, tf.distribute.DistributedValues):
        return leaf
    return max(leaf.values, key=lambda v: v.shape[0] if v.shape.rank else 0)


def _fully_built(model) -> bool:
    """True when Keras' `_symbolic_build` would build nothing."""
    if not all(layer.built for layer in model._flatten_layers()):
        return False
    parts = ("_compile_metrics", "_compile_loss", "optimizer")
    for part in (getattr(model, name, None) for name in parts):
        if part is not None and not part.built:
            return False
    return True


def _packed_reduce_per_replica(values, strategy, reduction):
    if (
        isinstance(strategy, KerasCompatMixin)
        and reduction in ("auto", "mean")
        and tf_trainer._collective_all_reduce_multi_worker(strategy)
    ):
        # What the stock function does leaf by leaf, in one call.
        return strategy.reduce("MEAN", values, axis=0)
    return _stock_reduce_per_replica(values, strategy, reduction)


def _stack_on_device(scalars):
    """One replica's scalars as a vector, on that replica's device."""
    with tf.device(scalars[0].device):
        return tf.stack(scalars)


def _local_scalars(leaf, num_local_replicas):
    """A packable leaf's per-replica floating scalars, else `None`.

    A plain tensor counts as the value of the only local replica, as
    `CrossDeviceOps.reduce` treats it.
    """
    if isinstance(leaf, tf_values.PerReplica):
        values = leaf.values
    elif tf.is_tensor(leaf) and num_local_replicas == 1:
        values = (leaf,)
    else:
        return None
    first = values[0]
    if first.shape.rank != 0 or not first.dtype.is_floating:
        return None
    return values


def _leaf_axis(value, axis):
    """`None` for a scalar value: it has no axis 0 to reduce within."""
    if axis is None:
        return None
    first = value
    if isinstance(value, tf.distribute.DistributedValues):
        first = value.values[0]
    rank = getattr(getattr(first, "shape", None), "rank", None)
    return None if rank == 0 else axis
