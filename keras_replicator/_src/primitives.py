"""Cross-replica primitives: MPI-like collectives callable inside a replica.

TF-Replicator's primitives on the public `tf.distribute.ReplicaContext` API,
so they work under every strategy (with no strategy: one replica, identity).

As in the paper and the tf.distribute RFC, if one replica calls a primitive,
all must, in the same order, with the same nest structure, shapes and
dtypes; pass a whole dict to one call rather than loop. On CPU and
multi-worker strategies a collective cannot sit in a `tf.cond` or a Python
`if` on a tensor: `merge_call` refuses ("`merge_call` called while defining
a new graph"), so compute both sides and pick with `tf.where`.
"""

from __future__ import annotations

import tensorflow as tf

from keras_replicator._src import collectives
from keras_replicator._src.core import validation
from keras_replicator._src.core.types import TensorTree

try:  # Keras 3: true while Keras infers output shapes from symbolic inputs.
    from keras_replicator._src.upstream import in_symbolic_scope
except ImportError:  # pragma: no cover - older or newer Keras layouts.

    def in_symbolic_scope() -> bool:
        """Keras without a symbolic scope: never symbolic."""
        return False


REDUCE_OPS = ("sum", "mean", "max", "min")

_WHERE_TO_CALL = (
    "Call it in a replica context: inside the `step_fn` of "
    "`replicator.replicate`, inside `strategy.run`, or inside a Keras "
    "`train_step` or layer `call` running under a replicator."
)


def all_reduce(value: TensorTree, op: str = "sum") -> TensorTree:
    """Reduces `value` across all replicas in sync, on every worker.

    Sum and mean are one batched, differentiable collective for the whole
    nest (an all-sum's gradient is an all-sum). TensorFlow has no max or
    min all-reduce: those gather and reduce locally, moving `num_replicas`
    times more data, so keep their inputs small (scalars, statistics). Call
    it in a replica context (`step_fn`, `strategy.run`, a Keras
    `train_step` or layer `call` under a replicator).

    Args:
        value: A tensor or nested structure of tensors, the same structure,
            shapes and dtypes on every replica.
        op: One of `"sum"`, `"mean"`, `"max"`, `"min"`. Defaults to `"sum"`.

    Returns:
        A structure like `value`, identical on every replica.

    Raises:
        ValueError: If `op` is not supported.
        RuntimeError: If called in cross-replica context.
    """
    if op not in REDUCE_OPS:
        raise ValueError(
            f"`op` must be one of {REDUCE_OPS}. Received: op={op!r}"
        )
    ctx = _replica_context("all_reduce")
    if ctx is None:
        return _symbolic(value)
    flat = [_local(v) for v in tf.nest.flatten(value)]
    if op in ("sum", "mean"):
        return tf.nest.pack_sequence_as(
            value, collectives.all_reduce(ctx, op, flat)
        )
    reduce_fn = tf.reduce_max if op == "max" else tf.reduce_min
    # Stack each replica's value on a new axis 0, then reduce over it.
    gathered = ctx.all_gather([tf.expand_dims(v, 0) for v in flat], axis=0)
    return tf.nest.pack_sequence_as(
        value, [reduce_fn(g, axis=0) for g in gathered]
    )


def all_sum(value: TensorTree) -> TensorTree:
    """Sums `value` across all replicas; see `all_reduce`.

    Args:
        value: A tensor or nested structure of tensors.

    Returns:
        The element-wise sum over replicas, identical on every replica.

    Raises:
        RuntimeError: If called in cross-replica context.
    """
    return _reduce_as(value, "sum", "all_sum")


def all_mean(value: TensorTree) -> TensorTree:
    """Averages `value` across all replicas; see `all_reduce`.

    Args:
        value: A tensor or nested structure of floating-point tensors.

    Returns:
        The element-wise mean over replicas, identical on every replica.

    Raises:
        RuntimeError: If called in cross-replica context.
    """
    return _reduce_as(value, "mean", "all_mean")


def all_max(value: TensorTree) -> TensorTree:
    """Element-wise maximum of `value` over all replicas; see `all_reduce`.

    Args:
        value: A tensor or nested structure of tensors.

    Returns:
        The element-wise maximum over replicas, identical on every replica.

    Raises:
        RuntimeError: If called in cross-replica context.
    """
    return _reduce_as(value, "max", "all_max")


def all_min(value: TensorTree) -> TensorTree:
    """Element-wise minimum of `value` over all replicas; see `all_reduce`.

    Args:
        value: A tensor or nested structure of tensors.

    Returns:
        The element-wise minimum over replicas, identical on every replica.

    Raises:
        RuntimeError: If called in cross-replica context.
    """
    return _reduce_as(value, "min", "all_min")


def all_gather(value: TensorTree, axis: int = 0) -> TensorTree:
    """Concatenates every replica's `value` along `axis`, in replica order.

    Worker 0's replicas come first. Shapes may differ only along `axis`; a
    scalar counts as a length-one vector: `all_gather(replica_id())` is
    `[0, 1, ..., n - 1]`.

    Args:
        value: A tensor or nested structure of tensors.
        axis: The axis to concatenate along. Defaults to 0.

    Returns:
        A structure like `value`, identical on every replica.

    Raises:
        TypeError: If `axis` is not an integer.
        RuntimeError: If called in cross-replica context.
    """
    if not validation.is_int(axis):
        raise TypeError(
            f"`axis` must be an integer. Received: axis={axis!r} "
            f"of type {type(axis).__name__}"
        )
    ctx = _replica_context("all_gather")
    flat = [_local(v) for v in tf.nest.flatten(value)]
    flat = [tf.reshape(v, [1]) if v.shape.rank == 0 else v for v in flat]
    if ctx is None:
        n = tf.distribute.get_strategy().num_replicas_in_sync
        gathered = [tf.concat([v] * n, axis=axis) for v in flat]
    else:
        gathered = ctx.all_gather(flat, axis=axis)
    return tf.nest.pack_sequence_as(value, gathered)


def broadcast(value: TensorTree, source_replica: int = 0) -> TensorTree:
    """Gives every replica the value of replica `source_replica`.

    Every replica evaluates `value`. It is an all-sum of the source's value
    and zeros elsewhere (the K-FAC TPU trick): one all-reduce's bytes, where
    gather-then-index moves `num_replicas` times more
    (`benchmarks/allreduce.py`).

    Args:
        value: A tensor or nested structure of numeric or boolean tensors.
        source_replica: The replica whose value everyone gets, in
            `[0, num_replicas)`. Defaults to 0.

    Returns:
        A structure like `value`, identical on every replica.

    Raises:
        ValueError: If `source_replica` is not a replica index.
        RuntimeError: If called in cross-replica context.
    """
    ctx = _replica_context("broadcast")
    n = (
        tf.distribute.get_strategy().num_replicas_in_sync
        if ctx is None
        else ctx.num_replicas_in_sync
    )
    if not validation.is_int(source_replica) or not 0 <= source_replica < n:
        raise ValueError(
            f"`source_replica` must be an integer in [0, {n}) (there are {n} "
            f"replicas). Received: source_replica={source_replica!r}"
        )
    if ctx is None:
        return _symbolic(value)
    is_source = tf.equal(_replica_id(ctx), source_replica)
    flat = [_local(v) for v in tf.nest.flatten(value)]
    # Booleans cannot be summed: send them as int32 and cast back.
    masked = [
        tf.where(is_source, _summable(v), tf.zeros_like(_summable(v)))
        for v in flat
    ]
    summed = collectives.all_reduce(ctx, "sum", masked)
    out = [tf.cast(s, v.dtype) for s, v in zip(summed, flat, strict=True)]
    return tf.nest.pack_sequence_as(value, out)


def replica_id() -> tf.Tensor:
    """This replica's index among all replicas of all workers, from 0.

    Returns:
        A scalar int32 tensor in `[0, num_replicas())`.

    Raises:
        RuntimeError: If called in cross-replica context.
    """
    ctx = _replica_context("replica_id")
    if ctx is None:
        return tf.constant(0, tf.int32)
    return _replica_id(ctx)


def num_replicas() -> int:
    """The number of replicas in sync, over all workers.

    Also works in cross-replica context (from the current strategy); 1
    outside any strategy.

    Returns:
        A Python int.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is not None:
        return ctx.num_replicas_in_sync
    return tf.distribute.get_strategy().num_replicas_in_sync


def _replica_context(name: str) -> tf.distribute.ReplicaContext | None:
    """The replica context, or None while Keras traces shapes symbolically.

    Keras builds layers in cross-replica context on symbolic placeholders to
    learn output shapes; the local value alone has the right shape and dtype.
    """
    if in_symbolic_scope():
        return None
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise RuntimeError(
            f"`{name}` was called in cross-replica context (inside "
            f"`strategy.scope()` but outside `strategy.run`). {_WHERE_TO_CALL}"
        )
    return ctx


def _reduce_as(value: TensorTree, op: str, name: str) -> TensorTree:
    _replica_context(name)  # Fail with this function's name, not all_reduce.
    return all_reduce(value, op)


def _replica_id(ctx: tf.distribute.ReplicaContext) -> tf.Tensor:
    # A Python int under MirroredStrategy, a tensor under TPU strategies.
    return tf.cast(ctx.replica_id_in_sync_group, tf.int32)


def _local(value) -> tf.Tensor:
    """`value` as a tensor made on this replica's device.

    With one replica per worker a variable read in `strategy.run` has no
    device and batch reduction fails ("destinations can not be empty").
    """
    return tf.identity(value)


def _summable(value: tf.Tensor) -> tf.Tensor:
    return tf.cast(value, tf.int32) if value.dtype == tf.bool else value


def _symbolic(value: TensorTree) -> TensorTree:
    """The local stand-in for a reduction during symbolic shape inference."""
    return tf.nest.map_structure(tf.identity, value)
