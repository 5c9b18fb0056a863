"""The one place that builds packed all-reduces and cross-worker sums.

Every collective keras-replicator issues goes through here (primitives,
gradient averaging, cross-replica batch norm, Keras' logs,
`MetricReduction`, sharded optimizer state). Values are grouped by dtype (a
collective carries one dtype; MirroredStrategy reduces int32 on the host
and floats on the devices and refuses to batch both) and each group goes
out as ONE collective, in sorted dtype order: every replica of every worker
must issue collectives in the same order, or they pair up different values
or hang. Sharded optimizer state splits groups into `buckets`
(`bucket_bytes=`) to hold less memory.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from keras_replicator._src.upstream import collective_ops
from keras_replicator._src.upstream import cross_device_ops
from keras_replicator._src.upstream import tf_values


def all_reduce(
    ctx: tf.distribute.ReplicaContext,
    op: str,
    values: Sequence[tf.Tensor | None],
    options: tf.distribute.experimental.CommunicationOptions | None = None,
    bucket_bytes: int | None = None,
) -> list[tf.Tensor | None]:
    """All-reduces a flat list in a replica context, one collective per dtype.

    `op` is `"sum"` or `"mean"`; None entries of `values` pass through; the
    result keeps their order. `options` are `CommunicationOptions` (e.g.
    `bytes_per_pack`: TensorFlow splits a group into overlapping packs).
    With `bucket_bytes`, each dtype goes out in `buckets` of that size: a
    value at least that large alone (in place, no concatenated copy).
    """
    groups: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        if v is not None:
            groups.setdefault(v.dtype.name, []).append(i)
    out = list(values)
    for dtype in sorted(groups):
        indices = groups[dtype]
        if bucket_bytes is None:
            packs = [indices]
        else:
            sizes = [_nbytes(values[i]) for i in indices]
            packs = [
                [indices[j] for j in bucket]
                for bucket in buckets(sizes, bucket_bytes)
            ]
        for pack in packs:
            reduced = ctx.all_reduce(
                op.upper(), [values[i] for i in pack], options
            )
            for i, r in zip(pack, reduced, strict=True):
                out[i] = r
    return out


def buckets(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Groups positions of byte `sizes` into buckets of about `limit` bytes.

    A value of at least `limit` is a bucket of its own; consecutive smaller
    ones share one while their total stays within `limit`. It depends on
    sizes only, so every replica makes the same buckets in the same order.
    """
    out: list[list[int]] = []
    total = limit  # No open bucket.
    for i, size in enumerate(sizes):
        if size >= limit:
            out.append([i])
            total = limit
        elif total + size > limit:
            out.append([i])
            total = size
        else:
            out[-1].append(i)
            total += size
    return out


def _nbytes(value) -> int:
    count = value.shape.num_elements()
    if isinstance(value, tf.IndexedSlices) or count is None:
        # Alone: a sparse gradient's size depends on the batch, and the
        # buckets must depend on the variables only.
        return 2**62
    return count * value.dtype.size


def all_gather_equal(
    ctx: tf.distribute.ReplicaContext, shard: tf.Tensor
) -> tf.Tensor:
    """All-gathers a rank-1 shard of the same length on every replica.

    Returns the shards concatenated in replica order. Lengths are equal
    (static, or padded in the graph as ModelParallel pads its rows), so in
    a graph this is ONE `CollectiveGatherV2` from this replica's launcher
    (its group, instance keys, ordering token); `ReplicaContext.all_gather`
    allows unequal lengths: it gathers the shapes, pads, and copies the
    unpadded pieces into a second full-size buffer. Eagerly, or without
    collective launchers, it falls back to that.
    """
    dtype = shard.dtype
    if dtype not in _GATHER_DTYPES:
        # TensorFlow's CPU gather takes only these dtypes: bfloat16
        # (keras-hub's presets) travels as float16 bits; others widened.
        wide = tf.float16 if dtype.size == 2 else _wider(dtype)
        moved = (
            tf.bitcast(shard, wide)
            if wide.size == dtype.size
            else tf.cast(shard, wide)
        )
        gathered = all_gather_equal(ctx, moved)
        if wide.size == dtype.size:
            return tf.bitcast(gathered, dtype)
        return tf.cast(gathered, dtype)
    launcher = _launcher(ctx)
    if launcher is None:
        return ctx.all_gather(shard, axis=0)
    with tf.name_scope("allgather"):
        return launcher._all_gather(shard, None)


def all_to_all_equal(
    ctx: tf.distribute.ReplicaContext, pieces: tf.Tensor
) -> tf.Tensor:
    """Sends `pieces[j]` to replica `j`; returns what each replica sent here.

    `pieces` is `(num_replicas_in_sync, ...)`, the same shape on every
    replica at run time (later dimensions may be unknown when traced), and
    non-empty: TensorFlow's CPU all-to-all fails on none. Replica `r` gets
    that shape back, `[j]` being replica `j`'s `pieces[r]`. In a graph this
    is ONE `CollectiveAllToAllV2` with this replica's launcher's keys and
    ordering token (over MPI: one `Alltoall`), moving only what each replica
    needs; eagerly, or without launchers, an all-gather of all pieces.
    """
    dtype = pieces.dtype
    if dtype not in _GATHER_DTYPES and dtype != tf.bfloat16:
        wide = _wider(dtype)
        return tf.cast(all_to_all_equal(ctx, tf.cast(pieces, wide)), dtype)
    launcher = _launcher(ctx)
    if launcher is None:
        replicas = ctx.num_replicas_in_sync
        gathered = tf.reshape(
            all_gather_equal(ctx, tf.reshape(pieces, [-1])),
            tf.concat([[replicas * replicas], tf.shape(pieces)[1:]], 0),
        )
        here = ctx.replica_id_in_sync_group
        return tf.gather(gathered, tf.range(replicas) * replicas + here)
    with tf.name_scope("alltoall"):
        if hasattr(launcher, "all_to_all"):  # Over MPI.
            return launcher.all_to_all(pieces)
        options = launcher._options  # noqa: SLF001
        instance_key = launcher._next_instance_key()  # noqa: SLF001
        with tf.device(launcher._device):  # noqa: SLF001
            out = collective_ops.all_to_all_v2(
                pieces,
                launcher._group_size,  # noqa: SLF001
                launcher._group_key,  # noqa: SLF001
                instance_key,
                communication_hint=options.implementation.value,
                timeout=options.timeout_seconds,
                ordering_token=launcher._get_ordering_token(),  # noqa: SLF001
            )
        out.set_shape(pieces.shape)
        return out


def all_reduce_sum(ctx: tf.distribute.ReplicaContext, value: tf.Tensor):
    """Sums one dense tensor over the replicas, without `merge_call`.

    One `CollectiveReduceV2` from this replica's launcher, so it may sit in
    a `tf.cond` branch; eagerly, or without launchers, `ctx.all_reduce`.
    """
    launcher = _launcher(ctx)
    if launcher is None:
        return ctx.all_reduce("SUM", value)
    with tf.name_scope("allreduce"):
        return launcher.all_reduce(value)


# What `CollectiveGatherV2` takes on the CPU.
_GATHER_DTYPES = frozenset(
    {tf.float16, tf.float32, tf.float64, tf.int32, tf.int64}
)


def _wider(dtype):
    if dtype.is_floating:
        return tf.float64 if dtype.size > 4 else tf.float32
    return tf.int64 if dtype.size > 4 else tf.int32


def _launcher(ctx):
    """This replica's `CollectiveReplicaLauncher`, or None where unusable."""
    if tf.executing_eagerly():
        # Eager replicas run in turn: a collective outside `merge_call`
        # would wait for the others forever.
        return None
    extended = ctx.strategy.extended
    # MirroredStrategy keeps them in `_collective_ops` (even when reducing
    # with other cross-device ops), the multi-worker one `_cross_device_ops`.
    for name in ("_collective_ops", "_cross_device_ops"):
        ops = getattr(extended, name, None)
        if isinstance(ops, cross_device_ops.CollectiveAllReduce):
            return ops._launchers[ctx._replica_id]
    return None


def reduce_scalars(
    reduce_fn: Callable[..., tf.Tensor],
    reduce_op,
    leaves: Sequence,
    num_local_replicas: int,
) -> list:
    """Reduces the scalar per-replica leaves of a nest, packed by dtype.

    In cross-replica context (Keras' `reduce_per_replica` of a step's logs)
    the floating scalar leaves of a dtype are stacked per replica device and
    reduced in one `reduce_fn(reduce_op, value, axis=None)` (the strategy's
    stock `reduce`). `leaves` are `PerReplica` values or tensors (with one
    local replica `run` returns plain tensors). Returns a list like
    `leaves`: packed ones reduced, others None for the caller to reduce.
    """
    local = [_local_scalars(leaf, num_local_replicas) for leaf in leaves]
    groups: dict[str, list[int]] = {}
    for i, values in enumerate(local):
        if values is not None:
            groups.setdefault(values[0].dtype.name, []).append(i)
    reduced = [None] * len(leaves)
    for dtype in sorted(groups):
        indices = groups[dtype]
        if len(indices) == 1:
            continue
        columns = zip(*(local[i] for i in indices), strict=True)
        stacked = tf_values.PerReplica(
            tuple(_stack_on_device(column) for column in columns)
        )
        packed = reduce_fn(reduce_op, stacked, axis=None)
        for i, unpacked in zip(indices, tf.unstack(packed), strict=True):
            reduced[i] = unpacked
    return reduced


def sum_over_workers(
    strategy: tf.distribute.Strategy, vector: np.ndarray, num_workers: int
) -> np.ndarray:
    """Sums a NumPy vector over the workers of `strategy`: one all-reduce.

    Call it eagerly, in cross-replica context, on every worker.
    """
    per_worker = strategy.num_replicas_in_sync // num_workers

    def value_fn(ctx):
        # Each worker's first replica carries the vector; others add zeros.
        first = ctx.replica_id_in_sync_group % per_worker == 0
        return tf.constant(vector if first else np.zeros_like(vector))

    values = strategy.experimental_distribute_values_from_function(value_fn)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None)
    return np.asarray(total)


def _stack_on_device(scalars):
    """One replica's scalars as a vector, on that replica's device."""
    with tf.device(scalars[0].device):
        return tf.stack(scalars)


def _local_scalars(leaf, num_local_replicas):
    """A packable leaf's per-replica floating scalars, else `None`."""
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
