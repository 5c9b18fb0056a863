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

Both go through OUR strategy's `reduce`, so no Keras code is patched for
them: `MultiWorkerReplicator.reduce` maps over nests and reduces a scalar's
"axis 0" across replicas, as `MirroredStrategy`'s `reduce_mean(local_results,
axis=0)` branch does: one device's mean when replicas see equal examples.

Keras reduces each log value with its own call (k + 1 small all-reduces for
k metrics, besides the gradients'). Here it hands `reduce` the whole log dict
once, and the scalars go in ONE all-reduce (a stacked vector).

Every `fit`/`evaluate` also calls `_maybe_symbolic_build`, which pulls a
batch from a fresh iterator and reduces the WHOLE batch (across workers, an
all-reduce) to learn its shapes, even when all is built. Under our local and
multi-worker replicators it is replaced:

- all built: nothing (one iterator and one batch-sized all-reduce less per
  call, about 0.1-0.3 s here). Closer to one device than stock: the extra
  iterator advanced a reshuffling dataset by one order per call, and
  dropped a one-shot generator's pulled batch;
- otherwise it builds from the distributed dataset's `element_spec`, with no
  iterator, so a reshuffling dataset's first epoch has one device's order
  (stock under `MirroredStrategy` starts one order later, every epoch off);
- sparse or ragged leaves, or unknown dimensions past the batch's: it pulls
  a batch and builds from this process's largest replica batch, with no
  collective (Keras' mean fails with "Inputs to operation AddN ... must
  have the same size and shape" when a replica gets no examples: 3 on 4).

An epoch's logs (`get_metrics_result`) read each metric variable, a
sync-on-read sum: across workers, one eager all-reduce per variable (a
mean's total and count: two). Under our multi-worker replicators they are
summed in one packed all-reduce and the metrics' `result()` reads the sums
(`keras.StatelessScope`): the same values, one collective per read.

`PATCH.pins` records the exact Keras source lines this relies on;
`tests/test_patches.py` fails when a Keras upgrade changes them.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer
from tensorflow.python.distribute import values as values_lib

from keras_replicator._src import upstream
from keras_replicator._src.core import traits
from keras_replicator._src.patches import registry


def _maybe_symbolic_build(original, self, iterator=None, data_batch=None):
    """Keras' method, built from a local batch under our replicators."""
    strategy = self._distribute_strategy
    if not traits.is_in_graph(strategy):
        return original(self, iterator=iterator, data_batch=data_batch)
    if _fully_built(self):
        return None
    if iterator is not None:
        data_batch = _batch_spec(iterator)
    if iterator is not None and data_batch is None:
        # `(step, iterator)` on Keras 3.10, `(begin_step, end_step,
        # iterator)` since 3.11.
        for *_, it in iterator:
            data_batch = tf.nest.map_structure(_largest_local, next(it))
            break
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)
    return None


def _batch_spec(iterator):
    """One replica's batch as `tf.TensorSpec`s, or None if not all known.

    From the distributed dataset's `element_spec`: no iterator to advance a
    reshuffling dataset's order. None (a batch is pulled) for sparse or
    ragged leaves and unknown dimensions past the batch's.
    """
    dataset = getattr(iterator, "_distributed_dataset", None)
    try:
        spec = dataset.element_spec
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None
    leaves = tf.nest.flatten(spec)
    specs = []
    for leaf in leaves:
        if isinstance(leaf, values_lib.PerReplicaSpec):
            leaf = leaf._value_specs[0]
        if type(leaf) is not tf.TensorSpec:
            return None
        if leaf.shape.rank is None or not leaf.shape[1:].is_fully_defined():
            return None
        specs.append(leaf)
    return tf.nest.pack_sequence_as(spec, specs)


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


def _packed_reduce_per_replica(original, values, strategy, reduction):
    if (
        traits.kind(strategy) == "multi_worker"
        and reduction in ("auto", "mean")
        and tf_trainer._collective_all_reduce_multi_worker(strategy)
    ):
        # What the stock function does leaf by leaf, in one call; the
        # replicator's `reduce` packs the scalars into one all-reduce.
        return strategy.reduce("MEAN", values, axis=0)
    return original(values, strategy, reduction)


def _packed_metrics_result(original, self):
    strategy = self._distribute_strategy
    if (
        traits.kind(strategy) != "multi_worker"
        or not tf.executing_eagerly()
        or (
            tf.distribute.has_strategy()
            and not tf.distribute.in_cross_replica_context()
        )
    ):
        return original(self)
    summed = [
        (variable, variable._value)
        for metric in self.metrics
        for variable in metric.variables
        if _summed_on_read(getattr(variable, "_value", None))
    ]
    if len(summed) < 2:
        return original(self)
    reads = [
        values_lib.PerReplica(tuple(part.read_value() for part in s.values))
        for _, s in summed
    ]
    with strategy.scope():
        sums = strategy.reduce("SUM", reads, axis=None)
    mapping = []
    for (variable, stored), total in zip(summed, sums, strict=True):
        if stored.aggregation == tf.VariableAggregation.MEAN:
            total = total / strategy.num_replicas_in_sync
        mapping.append((variable, total))
    with keras.StatelessScope(state_mapping=mapping):
        return original(self)


def _summed_on_read(stored) -> bool:
    """A sync-on-read variable whose cross-replica read is a sum or mean."""
    return (
        isinstance(stored, tf.distribute.DistributedValues)
        and stored.synchronization == tf.VariableSynchronization.ON_READ
        and stored.aggregation
        in (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)
    )


PATCH = registry.register(
    registry.Patch(
        name="keras_compat",
        targets=(
            registry.Target(
                tf_trainer, "reduce_per_replica", _packed_reduce_per_replica
            ),
            registry.Target(
                upstream.TensorFlowTrainer,
                "_maybe_symbolic_build",
                _maybe_symbolic_build,
            ),
            registry.Target(
                upstream.TensorFlowTrainer,
                "get_metrics_result",
                _packed_metrics_result,
            ),
        ),
        applies_to=frozenset({"local", "multi_worker"}),
        pins=(
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                (
                    "data_batch = self.distribute_strategy.reduce(",
                    'return strategy.reduce("MEAN", v, axis=0)',
                    'return strategy.reduce("SUM", v)',
                    "return _multi_worker_concat(v, strategy)",
                    # The module global that the patch replaces.
                    "outputs = reduce_per_replica(",
                    # fit and evaluate call `_maybe_symbolic_build` before
                    # each run; the replacement does what these lines do.
                    "self._maybe_symbolic_build(iterator=epoch_iterator)",
                    "maybe_distributed_data_batch = next(it)",
                    "self._symbolic_build(data_batch=data_batch)",
                ),
            ),
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                ("for _, _, it in iterator:",),
                keras=">=3.11",
            ),
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                ("for _, it in iterator:",),
                keras="<3.11",
            ),
            # What `Trainer._symbolic_build` checks before it builds
            # anything; `_fully_built` checks the same.
            registry.Pin(
                "keras.src.trainers.trainer",
                (
                    "model_unbuilt = not all(layer.built for layer in "
                    "self._flatten_layers())",
                    "self._compile_metrics is not None",
                    "and not self._compile_metrics.built",
                    "self._compile_loss is not None and not "
                    "self._compile_loss.built",
                    "self.optimizer is not None and not self.optimizer.built",
                ),
                attributes=(f"{upstream.BASE_TRAINER}._symbolic_build",),
            ),
            # `_packed_metrics_result` maps what these `result()`s read.
            registry.Pin(
                "keras.src.trainers.trainer",
                ("for metric in self.metrics:", "result = metric.result()"),
            ),
        ),
        delete_when=(
            "Keras' TF trainer supports MultiWorkerMirroredStrategy "
            "(keras-team/keras#20585, tensorflow/tensorflow#72388) and "
            "builds from a local batch"
        ),
    )
)
