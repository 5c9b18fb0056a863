"""The one rule that combines the replicas' gradients.

Code follows one of two conventions (full account: `patches/replica_mean.py`):

- **One device's** (Keras' `fit`/`evaluate`, `replicate`, `wrap_optimizer`):
  each replica's loss is its own mean; gradients are AVERAGED, weighted by
  each replica's example count (`mean_gradients`).
- **tf.distribute's** (the user's own `strategy.run`): each replica's loss
  is its share of the global loss; gradients are SUMMED.

`one_device_convention` decides at trace time, from the running replica
step (`core/replica_step.py`) and the `gradient_reduction=` override. The
patches, `training/optimizer.py` and `sharding/sharded.py` call down to
this module; it imports no patch.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from keras_replicator._src import collectives
from keras_replicator._src.core import replica_step
from keras_replicator._src.core import traits

# The replicator kinds whose updates follow this rule.
KINDS = frozenset({"local", "multi_worker"})
_ONE_DEVICE_APIS = (replica_step.KERAS, replica_step.REPLICATOR)

_lock = threading.Lock()
# id(optimizer) -> calls in flight that gave it averaged gradients (its own
# cross-replica sum is off).
_sum_off: dict[int, int] = {}
# id(optimizer) -> outer optimizers in flight that averaged for it (its
# `apply` must not average again).
_fed: dict[int, int] = {}


def is_ours(strategy=None) -> bool:
    """True under `LocalReplicator` and `MultiWorkerReplicator`."""
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    return traits.kind(strategy) in KINDS


def gradient_reduction(strategy) -> str:
    """The replicator's override: `"auto"`, `"mean"` or `"sum"`."""
    return getattr(strategy, "gradient_reduction", "auto")


def one_device_convention(step=None, strategy=None) -> bool:
    """Whether losses in the running step are replicas' own means.

    True in Keras and `replicate` steps, False in the user's own
    `strategy.run`; `gradient_reduction="mean"` or `"sum"` overrides.
    """
    strategy = strategy or tf.distribute.get_strategy()
    reduction = gradient_reduction(strategy)
    if reduction != "auto":
        return reduction == "mean"
    step = step or replica_step.current()
    return step is not None and step.api in _ONE_DEVICE_APIS


def mean_gradients(
    grads, ctx=None, wire_dtype=None, options=None, bucket_bytes=None
):
    """Averages `grads` over all replicas, weighted by example counts.

    In a replica context (`ctx`, default the current one), one packed
    all-reduce per dtype (or bucket, `bucket_bytes`) carries the weighted
    gradients (tensors or `IndexedSlices`; None passes through) and the
    weights. A step whose losses are shares averages equally (shares
    already weigh their examples). With `wire_dtype`, floating gradients
    wider than 16 bits travel in it. Keeps the order and dtypes of `grads`.
    """
    ctx = ctx or tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync
    if replicas == 1:
        return list(grads)
    count = _varying_count()
    if count is None:
        # Equal (or unknown) counts: the plain mean.
        return scaled_sum(
            grads, ctx, 1.0 / replicas, wire_dtype, options, bucket_bytes
        )
    # `/ replicas` keeps the sums as small as the stock ones.
    weight = count * (1.0 / replicas)
    sent = [_to_wire(_times(g, weight), wire_dtype) for g in grads]
    reduced = collectives.all_reduce(
        ctx, "sum", [*sent, weight], options, bucket_bytes
    )
    inverse = tf.math.reciprocal_no_nan(reduced.pop())
    return [
        None if r is None else _times(_cast(r, g.dtype), inverse)
        for r, g in zip(reduced, grads, strict=True)
    ]


def _varying_count():
    """The running step's example count if replicas may differ, else None.

    None without a step, when losses are shares (already weighted), or for
    a Python int count (the same static batch everywhere).
    """
    step = replica_step.current()
    if step is None or step.shares or isinstance(step.count, int):
        return None
    return step.count


def replica_weights(ctx, dtype=tf.float32) -> tf.Tensor:
    """This replica's scalar weight in `mean_gradients` (sum of `w_r * g_r`).

    For a gradient computed from every replica's examples at once (a sharded
    kernel's block, `sharding/contraction.py`) to scale each replica's rows.
    Costs one scalar all-reduce when the counts may differ.
    """
    replicas = ctx.num_replicas_in_sync
    if replicas == 1:
        return tf.constant(1.0, dtype)
    count = _varying_count()
    if count is None:
        return tf.constant(1.0 / replicas, dtype)
    weight = tf.cast(count, dtype) * (1.0 / replicas)
    # No `merge_call`: a product may sit in a loop (keras-hub's `generate`).
    total = collectives.all_reduce_sum(ctx, weight)
    return weight * tf.math.reciprocal_no_nan(total)


def wrapped_gradients(grads, ctx, wire_dtype=None, options=None):
    """Combines `grads` for `ReplicatedOptimizer`: averaged or summed.

    Averages (one device's numbers for a mean loss) unless the losses are
    shares: in the user's own `strategy.run` after a scaling helper or a
    Keras `Loss`, or under `gradient_reduction="sum"`. Arguments as in
    `mean_gradients`.
    """
    step = replica_step.current()
    strategy = ctx.strategy
    summed = gradient_reduction(strategy) == "sum" or (
        not one_device_convention(step, strategy)
        and step is not None
        and step.shares
    )
    if summed and ctx.num_replicas_in_sync > 1:
        return scaled_sum(grads, ctx, 1.0, wire_dtype, options)
    return mean_gradients(grads, ctx, wire_dtype, options)


def scaled_sum(grads, ctx, scale, wire_dtype, options, bucket_bytes=None):
    """The sum over replicas of `grads` times `scale`, packed per dtype."""
    if scale != 1.0:
        grads_sent = [_times(g, scale) for g in grads]
    else:
        grads_sent = list(grads)
    sent = [_to_wire(g, wire_dtype) for g in grads_sent]
    reduced = collectives.all_reduce(ctx, "sum", sent, options, bucket_bytes)
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

    For an optimizer whose `apply` averaged itself (the patched `apply`,
    `ReplicatedOptimizer`): its and its inner optimizers' cross-replica
    sums are off, and the inner ones do not average again.
    """
    chain = _chain(optimizer)
    _enter(_sum_off, chain)
    _enter(_fed, chain[1:])
    try:
        yield
    finally:
        _exit(_fed, chain[1:])
        _exit(_sum_off, chain)


def sum_is_off(optimizer) -> bool:
    """Whether `optimizer` got averaged gradients: its own sum is off."""
    with _lock:
        return id(optimizer) in _sum_off


def is_fed(optimizer) -> bool:
    """Whether an outer optimizer averaged for `optimizer` already."""
    with _lock:
        return id(optimizer) in _fed
