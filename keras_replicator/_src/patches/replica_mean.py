"""One device's losses and gradients under our in-graph replicators.

The symptom: single-device Keras code under a `tf.distribute` strategy logs
or trains differently from one device. A custom `train_step` written as in
the keras-io guide logs loss / N; `keras.optimizers.SGD(
gradient_accumulation_steps=2)` fails with "`merge_call` called while
defining a new graph or a tf.function"; `clipnorm` and `clipvalue` clip each
replica's partial gradient; a `keras.losses.Loss` object in a `step_fn` with
a mean-averaging optimizer trains N times too slowly; a ragged last batch
(29 and 28 examples) weighs its examples unequally.

The cause is one Keras 3.15 convention (TensorFlow backend):

- `keras/src/losses/loss.py`: `scale_loss_for_distribution` divides every
  reduced loss by `num_replicas_in_sync` (`Loss` objects via
  `reduce_values`, `compute_loss`, the regularization losses), and the
  stock `train_step`/`test_step` multiply it back with
  `unscale_loss_for_distribution` for their loss tracker; a custom step does
  not;
- `keras/src/backend/tensorflow/optimizer.py`: `_backend_update_step` SUMS
  the gradients across replicas (`_all_reduce_sum_gradients`), i.e. AFTER
  loss-scale unscaling and clipping, and INSIDE the `tf.cond` of gradient
  accumulation, whose branches then need a `merge_call` that
  `MirroredStrategy` refuses there.

The fix, under `LocalReplicator` and `MultiWorkerReplicator` only (this
patch's `applies_to`; every other strategy and no strategy run the
originals):

1. Losses are not pre-divided: `scale_loss_for_distribution` and
   `unscale_loss_for_distribution` return their argument. So every loss a
   replica computes (a `Loss` object's, `compute_loss`'s) is its own batch's
   mean, as on one device, and what a custom step logs is one device's
   number. The stock steps' loss trackers are unchanged (they unscaled).
2. Every optimizer averages the gradients across all replicas exactly once,
   at the START of `apply`: before loss-scale unscaling, clipping,
   accumulation, weight decay and the update, which therefore all act on
   the global gradient as on one device. The mean is weighted by each
   replica's example count (`core/example_count.py`), so a global batch
   split unevenly weighs every example as one device does; the count
   travels in the same packed all-reduce as the gradients (no extra
   collective). When the batch size is static (the same on every replica)
   or unknown, it is the plain mean. Hot-path cost against stock Keras:
   one multiplication per gradient before the sum, plus one after it when
   the batch size is dynamic (NumPy input), and a scalar in the pack.
   Keras' own later sum is switched off for that optimizer and the
   optimizers it wraps.
3. The rest of the update needs no cross-replica step: the gradients are
   the same on every replica, so each replica updates its own copy of each
   variable in replica context, as `MirroredStrategy` already does on GPUs
   under XLA (`_use_merge_call()` is False for the duration, on this
   thread only). So the `tf.cond` of gradient accumulation and of
   `ema_overwrite_frequency` contains no `merge_call`. A wrapping optimizer
   (`LossScaleOptimizer`) keeps its stock cross-replica decision, which is
   now the same on every replica and every worker (stock Keras took replica
   0's unreduced gradients' finiteness, per worker).

`ReplicatedOptimizer` (`wrap_optimizer`) averages on its own (packed,
compressed, accumulated) and marks its inner optimizers with
`receiving_reduced`, so they do not average again.

Everything a step computes from its loss is one replica's mean over its own
examples. A custom step that tracks `metric.update_state(loss)` without a
sample weight averages the replicas' means: one device's number when every
replica has the same number of examples. The stock steps weigh by the batch
size and are exact for any split.

`PATCH.pins` records the exact Keras source lines this relies on;
`tests/test_patches.py` fails when a Keras upgrade changes them.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.losses import loss as loss_module
from keras.src.optimizers import base_optimizer
from keras.src.optimizers import loss_scale_optimizer
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import mirrored_strategy

from keras_replicator._src import collectives
from keras_replicator._src.core import example_count
from keras_replicator._src.core import traits
from keras_replicator._src.patches import registry

KINDS = frozenset({"local", "multi_worker"})

_lock = threading.Lock()
# id(optimizer) -> how many calls in flight gave it averaged gradients:
# its own cross-replica sum is off.
_sum_off: dict[int, int] = {}
# id(optimizer) -> how many outer optimizers in flight averaged for it: its
# `apply` must not average again.
_fed: dict[int, int] = {}
# `no_merge`: depth of leaf `apply` calls on this thread that update each
# replica's copies in replica context.
_local = threading.local()


def is_ours(strategy=None) -> bool:
    """True under `LocalReplicator` and `MultiWorkerReplicator`."""
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    return traits.kind(strategy) in KINDS


def _scale(original, value):
    if is_ours():
        return value
    return original(value)


def _unscale(original, value):
    if is_ours():
        return value
    return original(value)


def mean_gradients(grads, ctx=None, wire_dtype=None, options=None):
    """Averages `grads` over all replicas, weighted by example counts.

    Call it in a replica context. One packed all-reduce (per dtype) carries
    the weighted gradients and the weights.

    Args:
        grads: Gradients (tensors or `IndexedSlices`); None entries are
            passed through.
        ctx: The replica context. Defaults to the current one.
        wire_dtype: If set, floating gradients wider than 16 bits travel in
            this dtype and are cast back.
        options: Optional `tf.distribute.experimental.CommunicationOptions`.

    Returns:
        The averaged gradients, in the order and dtypes of `grads`.
    """
    ctx = ctx or tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync
    if replicas == 1:
        return list(grads)
    count = example_count.current()
    if count is None or isinstance(count, int):
        # Every replica has the same number of examples (or none is known):
        # the plain mean, one multiplication per gradient.
        return _equal_mean(grads, ctx, replicas, wire_dtype, options)
    # weight = count / replicas: the common factor keeps the sums as small
    # as the stock ones. The weights travel in the gradients' pack.
    weight = count * (1.0 / replicas)
    sent = [_to_wire(_times(g, weight), wire_dtype) for g in grads]
    reduced = collectives.all_reduce(ctx, "sum", [*sent, weight], options)
    inverse = tf.math.reciprocal_no_nan(reduced.pop())
    return [
        None if r is None else _times(_cast(r, g.dtype), inverse)
        for r, g in zip(reduced, grads, strict=True)
    ]


def _equal_mean(grads, ctx, replicas, wire_dtype, options):
    scale = 1.0 / replicas
    sent = [_to_wire(_times(g, scale), wire_dtype) for g in grads]
    reduced = collectives.all_reduce(ctx, "sum", sent, options)
    return [
        None if r is None else _cast(r, g.dtype)
        for r, g in zip(reduced, grads, strict=True)
    ]


def _to_wire(g, wire_dtype):
    if (
        g is not None
        and wire_dtype is not None
        and g.dtype.is_floating
        and g.dtype.size > 2
    ):
        return _cast(g, wire_dtype)
    return g


def _times(g, factor):
    if g is None:
        return None
    factor = tf.cast(factor, g.dtype)
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
    return g * factor


def _cast(g, dtype):
    if g.dtype == dtype:
        return g
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.cast(g.values, dtype), g.indices, g.dense_shape
        )
    return tf.cast(g, dtype)


def _chain(optimizer):
    """`optimizer` and the optimizers it wraps (`inner_optimizer`)."""
    found = []
    while optimizer is not None and optimizer not in found:
        found.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return found


def _enter(table, optimizers):
    with _lock:
        for opt in optimizers:
            table[id(opt)] = table.get(id(opt), 0) + 1


def _exit(table, optimizers):
    with _lock:
        for opt in optimizers:
            left = table[id(opt)] - 1
            if left:
                table[id(opt)] = left
            else:
                del table[id(opt)]


@contextlib.contextmanager
def receiving_reduced(optimizer):
    """While open, `optimizer`'s inner optimizers get averaged gradients.

    For an optimizer that averaged the gradients itself (the patched
    `apply`, `ReplicatedOptimizer`): its own and its inner optimizers'
    cross-replica sums are off, and the inner ones do not average again.

    Args:
        optimizer: The optimizer whose `apply` averaged the gradients.

    Yields:
        None.
    """
    chain = _chain(optimizer)
    _enter(_sum_off, chain)
    _enter(_fed, chain[1:])
    try:
        yield
    finally:
        _exit(_fed, chain[1:])
        _exit(_sum_off, chain)


@contextlib.contextmanager
def _replica_local_updates(optimizer):
    """Updates in replica context, no `merge_call`, for a leaf optimizer.

    A wrapping optimizer (one with an `inner_optimizer`, e.g. a
    `LossScaleOptimizer`) keeps the stock path: it decides in cross-replica
    context, and its inner optimizer's `apply` comes here again.
    """
    if hasattr(optimizer, "inner_optimizer"):
        yield
        return
    _local.no_merge = getattr(_local, "no_merge", 0) + 1
    try:
        yield
    finally:
        _local.no_merge -= 1


def _apply(original, self, grads, trainable_variables=None):
    ctx = tf.distribute.get_replica_context()
    if (
        ctx is None
        or not is_ours(ctx.strategy)
        or ctx.num_replicas_in_sync == 1
    ):
        return original(self, grads, trainable_variables)
    with _lock:
        fed = id(self) in _fed
    if fed:
        with _replica_local_updates(self):
            return original(self, grads, trainable_variables)
    grads = mean_gradients(list(grads), ctx)
    with receiving_reduced(self), _replica_local_updates(self):
        return original(self, grads, trainable_variables)


def _all_reduce_sum_gradients(original, self, grads_and_vars):
    with _lock:
        off = id(self) in _sum_off
    if off:
        return list(grads_and_vars)
    return original(self, grads_and_vars)


def _use_merge_call(original, self):
    if getattr(_local, "no_merge", 0):
        return False
    return original(self)


_KERAS_SOURCE_LINES = {
    "keras.src.losses.loss": (
        "loss = scale_loss_for_distribution(loss)",
        "def scale_loss_for_distribution(value):",
        "def unscale_loss_for_distribution(value):",
    ),
    "keras.src.backend.tensorflow.trainer": (
        "loss_module.unscale_loss_for_distribution(loss),",
        "return loss_module.scale_loss_for_distribution(loss)",
        "loss = self.optimizer.scale_loss(loss)",
    ),
    "keras.src.trainers.compile_utils": (
        "loss_module.unscale_loss_for_distribution(value),",
    ),
    # The sum this patch turns off, and the merge_calls it avoids.
    "keras.src.backend.tensorflow.optimizer": (
        "grads_and_vars = self._all_reduce_sum_gradients(grads_and_vars)",
        "tf.__internal__.distribute.interim.maybe_merge_call(",
        "distribution.extended.update(",
    ),
    # `apply` unscales, then clips, accumulates and updates: the averaged
    # gradients enter before all of it.
    "keras.src.optimizers.base_optimizer": (
        "grads = [g if g is None else g / scale for g in grads]",
        "self._backend_apply_gradients(grads, trainable_variables)",
        "grads = self._clip_gradients(grads)",
        "self._iterations.assign_add(1)",
    ),
    "keras.src.optimizers.loss_scale_optimizer": (
        "if tf.__internal__.distribute.strategy_supports_no_merge_call():",
        "self._stateful_handle_finite_grads,",
    ),
    # Without merge_call, a replica-context update touches this replica's
    # copy only.
    "tensorflow.python.distribute.mirrored_strategy": (
        "def _replica_ctx_update(self, var, fn, args, kwargs, group):",
        "var = var._get_replica(replica_id)",
    ),
}

PATCH = registry.register(
    registry.Patch(
        name="replica_mean",
        targets=(
            registry.Target(loss_module, "scale_loss_for_distribution", _scale),
            registry.Target(
                loss_module, "unscale_loss_for_distribution", _unscale
            ),
            registry.Target(base_optimizer.BaseOptimizer, "apply", _apply),
            registry.Target(
                loss_scale_optimizer.LossScaleOptimizer, "apply", _apply
            ),
            registry.Target(
                tf_optimizer.TFOptimizer,
                "_all_reduce_sum_gradients",
                _all_reduce_sum_gradients,
            ),
            registry.Target(
                mirrored_strategy.MirroredExtended,
                "_use_merge_call",
                _use_merge_call,
            ),
            registry.Target(
                collective_all_reduce_strategy.CollectiveAllReduceExtended,
                "_use_merge_call",
                _use_merge_call,
            ),
        ),
        applies_to=KINDS,
        pins=tuple(
            registry.Pin(module, lines)
            for module, lines in _KERAS_SOURCE_LINES.items()
        ),
        delete_when=(
            "Keras averages gradients once before clipping and accumulation "
            "under tf.distribute and stops pre-dividing losses "
            "(keras-team/keras: no issue filed yet)"
        ),
    )
)
