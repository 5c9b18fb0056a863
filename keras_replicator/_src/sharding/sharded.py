"""Sharded variables: stored as blocks, gathered when used (FSDP / ZeRO-3).

Under `keras.distribution.ModelParallel` a variable its layout map splits is
a `MirroredVariable` whose components DIFFER: replica `r`'s holds block `r`
(`layout.Placement.block`), as do the optimizer slots made from it (Keras
gives a slot its variable's layout). The Keras variable keeps its full shape.

Compute is data-parallel over all N devices of the mesh, whatever the axes'
names: each takes 1/N of the global batch. In the step a read is one
all-gather of the blocks (`gathered`); the gradient, averaged by
`gradients.mean_gradients` as every gradient of the step, is all-reduced and
cut to the replica's block, so the optimizer gets one device's numbers.
TensorFlow's CPU runtime has no reduce-scatter (`CollectiveReduceScatterV2`).

Outside a replica step (`get_weights`, `save_weights`, `numpy()`, a
checkpoint) the value is assembled on the host (`full_value`) and an
assignment cuts the value into blocks (`assign`), so files hold whole values
and load on any mesh or one device. Over several processes a process holds
only its replicas' components: the full value is one all-gather, which every
process must join (as `fit`'s callbacks and `save_weights` on every process
do), and an assignment writes the local blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from keras_replicator._src import collectives
from keras_replicator._src import gradients
from keras_replicator._src.core import placements
from keras_replicator._src.sharding import auto_layout
from keras_replicator._src.sharding import block_draw
from keras_replicator._src.sharding import layout as layout_lib
from keras_replicator._src.upstream import context
from keras_replicator._src.upstream import distribution_lib
from keras_replicator._src.upstream import mirrored_strategy


def sharding_strategy(variable: Any, shape) -> tuple[Any, Any, Any]:
    """`(replicator, placement, layout)` if `variable` is stored sharded.

    Sharded: the current strategy runs a `ModelParallel` whose layout for it
    splits a dimension; else `(None, None, None)`. Raises `ValueError` for a
    layout that does not fit (`layout.placement`).
    """
    strategy = tf.distribute.get_strategy()
    distribution = getattr(strategy, placements.DISTRIBUTION_ATTR, None)
    if not isinstance(distribution, distribution_lib.ModelParallel):
        return None, None, None
    # Lets an `auto_layout_map` see the variable Keras looks up by path.
    with auto_layout.laying_out(variable, shape):
        layout = distribution.get_variable_layout(variable)
    if layout is None or all(a is None for a in layout.axes):
        return None, None, None
    placement = layout_lib.placement(
        variable.path, shape, layout, distribution.device_mesh
    )
    return strategy, placement, layout


def create(variable: Any, value: Any, placement: Any, strategy: Any):
    """A `MirroredVariable` whose component `r` holds block `r` of `variable`.

    A callable `value` is called once, as on one device, so a seeded
    initializer draws the same numbers. `strategy`'s replicas are the mesh's
    devices in flat order. Refuses an `on_read` variable
    (`NotImplementedError`): a block cannot be aggregated on read.
    """
    if variable.synchronization == "on_read":
        raise NotImplementedError(
            "A variable with `synchronization='on_read'` cannot be sharded "
            "under ModelParallel on TensorFlow; leave it out of the layout "
            f"map. Received: variable path={variable.path!r}"
        )
    if strategy.num_replicas_in_sync != placement.num_devices:
        raise ValueError(
            f"The mesh has {placement.num_devices} devices but the replicator "
            f"running it {strategy.num_replicas_in_sync} replicas. "
            f"Received: variable path={variable.path!r}"
        )
    replicas = local_replicas(strategy)
    with tf.init_scope():
        # Only this process's blocks; a value not drawn block by block
        # exists whole for this variable only, until cut.
        full = value
        if callable(value):
            full = block_draw.draw(value, placement.full_shape, variable.dtype)
        if isinstance(full, (block_draw.Draw, block_draw.Fill)):
            blocks = full.blocks(placement, replicas)
        else:
            full = tf.convert_to_tensor(full, dtype=variable.dtype)
            blocks = {r: placement.block(full, r) for r in replicas}
        del full
        with strategy.scope(), _own_initial_values(strategy):
            stored = tf.Variable(
                blocks[replicas[0]],
                trainable=variable.trainable,
                name=variable.name,
                aggregation=variable._map_aggregation(variable.aggregation),
            )
        for component, r in zip(stored.values, replicas, strict=True):
            if r:
                component.assign(blocks.pop(r))
    return stored


@contextlib.contextmanager
def _own_initial_values(strategy):
    """Variables made here skip the multi-worker initial-value broadcast.

    `CollectiveAllReduceExtended` gives every process's first component the
    chief's initial value (a broadcast and a transient of a whole block per
    variable); here it keeps its own block. All processes create the same
    variables in order, so none waits for a broadcast the others skip.
    """
    extended = strategy.extended
    stock = getattr(type(extended), "_get_variable_creator_initial_value", None)
    if stock is None or not multi_process(strategy):
        yield
        return
    local = (
        mirrored_strategy.MirroredExtended._get_variable_creator_initial_value
    )

    def initial_value(replica_id, device, primary_var, **kwargs):
        if replica_id != 0:
            return local(
                extended,
                replica_id=replica_id,
                device=device,
                primary_var=primary_var,
                **kwargs,
            )

        def value_fn():
            with tf.device(device):
                value = kwargs["initial_value"]
                if callable(value):
                    value = value()
                return tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))

        return value_fn

    extended._get_variable_creator_initial_value = initial_value
    try:
        yield
    finally:
        del extended._get_variable_creator_initial_value


def local_replicas(strategy) -> list[int]:
    """The global replica ids of this process's replicas, in order."""
    count = len(strategy.extended.worker_devices)
    first = getattr(strategy.extended, "_id_in_cluster", 0) * count
    return list(range(first, first + count))


def multi_process(strategy) -> bool:
    return len(strategy.extended.worker_devices) < (
        strategy.num_replicas_in_sync
    )


def process_of(strategy) -> tuple[int, int]:
    """(this process's index, the process count) of `strategy`."""
    if strategy is None or not multi_process(strategy):
        return 0, 1
    local = len(strategy.extended.worker_devices)
    return (
        int(getattr(strategy.extended, "_id_in_cluster", 0)),
        strategy.num_replicas_in_sync // local,
    )


def all_blocks(ctx, block, placement) -> tf.Tensor:
    """The whole value: every replica's `block`, all-gathered in `ctx`."""
    flat = collectives.all_gather_equal(ctx, tf.reshape(block, [-1]))
    return placement.assemble(
        tf.reshape(flat, [placement.num_devices, *placement.local_shape])
    )


def gathered(variable: Any, ctx: tf.distribute.ReplicaContext) -> tf.Tensor:
    """A sharded variable's full value in a replica step: one all-gather.

    The gradient is the averaged full gradient cut to this replica's block.
    """
    placement = placements.of(variable)
    local = tf.convert_to_tensor(variable._value)
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    if replica is None:
        raise RuntimeError(
            "A sharded variable was read in a replica context whose replica "
            f"id is not static. Received: variable path={variable.path!r}"
        )
    replica = int(replica)

    @tf.custom_gradient
    def gather(block):
        full = all_blocks(ctx, block, placement)

        def grad(upstream):
            (reduced,) = gradients.mean_gradients([upstream], ctx)
            if isinstance(reduced, tf.IndexedSlices):
                return _sparse_block(reduced, placement, replica)
            return placement.block(reduced, replica)

        return full, grad

    return gather(local)


def _sparse_block(slices, placement, replica):
    """This replica's block of a sparse gradient, still sparse.

    An Embedding's `IndexedSlices` have one row per looked-up id, repeats
    included, which Keras' optimizers see as on one device (Adam's second
    moment squares each repeat on its own): kept in order are the rows in
    this replica's range, cut to its columns.
    """
    begin = placement.begin(replica)
    local = placement.local_shape
    indices = tf.cast(slices.indices, tf.int64)
    keep = tf.logical_and(indices >= begin[0], indices < begin[0] + local[0])
    values = tf.boolean_mask(slices.values, keep)
    if any(begin[1:]) or tuple(local[1:]) != tuple(placement.full_shape[1:]):
        values = tf.slice(values, [0, *begin[1:]], [-1, *local[1:]])
    return tf.IndexedSlices(
        values,
        tf.boolean_mask(indices, keep) - begin[0],
        tf.constant(local, tf.int64),
    )


def full_value(variable: Any) -> tf.Tensor:
    """The full value of a sharded variable, outside a replica step."""
    strategy = variable._value.distribute_strategy
    if multi_process(strategy):
        _all_processes_here(strategy, variable.path)
    return blocks_value(variable._value, placements.of(variable))


def blocks_value(stored: Any, placement: Any) -> tf.Tensor:
    """The whole value of block storage `stored`, outside a replica step.

    Replica `r`'s component of `stored` holds `placement.block(full, r)`:
    ModelParallel's blocks, or a sharded optimizer's flat shards
    (`optimizer_shards.flat_placement`). Over several processes this is one
    all-gather, which every process joins.
    """
    strategy = stored.distribute_strategy
    if multi_process(strategy):
        return _gather_blocks(strategy, stored, placement)
    blocks = [tf.convert_to_tensor(c) for c in stored.values]
    return placement.assemble(tf.stack(blocks))


# Host-side reads of sharded values, counted alike on every process.
_host_reads = itertools.count()
_DEFAULT_READ_TIMEOUT = 60.0
# The least bound of a wait for another process's work on files; a sharded
# checkpoint's default `timeout_seconds`.
FILE_WORK_SECONDS = 600.0


# Per thread, inside a whole save (`waiting_on_files`).
_saving = threading.local()


@contextlib.contextmanager
def waiting_on_files() -> Iterator[None]:
    """Host reads in here may wait for the chief writing a file.

    In a multi-process Keras save the chief writes each value before the
    read of the next, which every process joins: the others wait for work on
    files (`FILE_WORK_SECONDS`).
    """
    _saving.depth = getattr(_saving, "depth", 0) + 1
    try:
        yield
    finally:
        _saving.depth -= 1


def _all_processes_here(strategy, path: str) -> None:
    """Waits, bounded, until every process reads the same sharded value.

    The read is an all-gather, in which a process reading alone (a
    chief-only `model.get_weights()`) would wait forever; a barrier first
    makes it fail in time with a `RuntimeError` that says what to do.
    """
    if not tf.executing_eagerly():
        return
    read = next(_host_reads)
    saving = getattr(_saving, "depth", 0) > 0

    def message(seconds):
        if saving:
            return (
                "In a Keras save under several processes every process "
                "joins the chief's read of each sharded value, which it "
                "makes after writing the ones before; they did not meet "
                f"within {seconds:g} s (the chief may have failed). "
                f"Received: variable path={path!r}"
            )
        return (
            "Reading a variable sharded by ModelParallel outside a training "
            "step all-gathers its blocks from every process, so every "
            "process must read it at the same point: call `get_weights()`, "
            "`numpy()`, `save_weights` or `model.save` on every process "
            "(the chief alone writes the file), not under `if chief:`. The "
            f"other processes did not join this read within {seconds:g} s. "
            f"Received: variable path={path!r}"
        )

    wait_for_processes(
        strategy,
        f"keras_replicator/sharded_read/{read}",
        message,
        file_work=saving,
    )


def wait_for_processes(
    strategy,
    barrier: str,
    message: Callable[[float], str],
    file_work: bool = False,
) -> None:
    """A barrier of every process, or a `RuntimeError` of `message(seconds)`.

    `barrier` is an id every process passes, used once per cluster. The bound
    is the replicator's collective timeout, else its start-up timeout, else
    60 s; with `file_work` (the chief writing a whole save, deleting a
    backup) at least `FILE_WORK_SECONDS`, as for a sharded checkpoint: a
    model of many GB takes minutes to write.
    """
    seconds = (
        getattr(strategy, "collective_timeout_seconds", None)
        or getattr(strategy, "timeout_seconds", None)
        or _DEFAULT_READ_TIMEOUT
    )
    if file_work:
        seconds = max(seconds, FILE_WORK_SECONDS)
    barrier_of_processes(barrier, seconds, message)


def barrier_of_processes(
    barrier: str, seconds: float, message: Callable[[float], str]
) -> None:
    """All at the coordination service's `barrier`, else `message`'s error."""
    try:
        context.context().wait_at_barrier(barrier, int(seconds * 1000))
    except (tf.errors.OpError, RuntimeError) as error:
        raise RuntimeError(message(seconds)) from error


def publish(key: str, value: str) -> None:
    """Puts `value` under `key` in the coordination service, once a cluster."""
    context.context().set_config_key_value(key, value)


def published(key: str, seconds: float, message: Callable[[float], str]):
    """The value `publish`ed under `key` within `seconds`, else an error."""
    try:
        return context.context().get_config_key_value(key, int(seconds * 1000))
    except (tf.errors.OpError, RuntimeError) as error:
        raise RuntimeError(message(seconds)) from error


def _gather_blocks(strategy, stored, placement) -> tf.Tensor:
    """Every replica's block, all-gathered over the processes, assembled."""
    blocks = _local_blocks(strategy, stored)
    return strategy.experimental_local_results(
        _gather_function(strategy, placement, stored.dtype)(blocks)
    )[0]


def _local_blocks(strategy, stored) -> Any:
    """This process's components of `stored`, read, as a `PerReplica`.

    A value, not the variable: a cached `tf.function` captures a distributed
    variable argument at its first trace, so a later call with another
    variable of the same shape would read the first one.
    """
    first = local_replicas(strategy)[0]
    components = stored.values
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.convert_to_tensor(
            components[ctx.replica_id_in_sync_group - first]
        )
    )


# The strategy's {(placement without its path, dtype): gather function}. On
# the strategy, since they close over it: a module cache would keep alive
# every replicator a notebook ever built.
_GATHERS_ATTR = "_keras_replicator_gathers"


def _gather_function(strategy, placement, dtype):
    """One `tf.function` per strategy and signature, traced once.

    Not one per read, which retraced at every read (`save_weights` reads
    each variable): the blocks are an argument, so every variable of one
    placement and dtype shares one trace.
    """
    gathers = getattr(strategy, _GATHERS_ATTR, None)
    if gathers is None:
        gathers = {}
        setattr(strategy, _GATHERS_ATTR, gathers)
    # The path names the variable in messages only: not in the key.
    shape_of = dataclasses.replace(placement, path="")
    key = (shape_of, dtype)
    if key not in gathers:

        def replica_fn(local):
            ctx = tf.distribute.get_replica_context()
            return all_blocks(ctx, local, shape_of)

        # `run` in a tf.function: one collective, issued by every replica.
        gathers[key] = tf.function(
            lambda blocks: strategy.run(replica_fn, args=(blocks,))
        )
    return gathers[key]


# Datasets smaller than this are read whole: mapping them saves nothing.
_MAP_AT_BYTES = 1 << 20


def mapped_dataset(dataset: Any) -> np.ndarray | None:
    """A read-only memory map of an h5py dataset's bytes, or None.

    Keras 3.12 and later read each `.weights.h5` value whole before
    `assign`, so under `ModelParallel` a process would briefly hold the
    largest variable (a language model's embedding table) whole. A map is an
    array too, of which `assign` reads only this process's blocks. Only where
    it means the data exactly: a file on disk (h5py's default driver), stored
    contiguously (no chunks, so no filter), of a plain numeric dtype or
    Keras' bfloat16 (2 opaque bytes); else None: read it whole.
    """
    import h5py  # Keras' own dependency for `.weights.h5`.

    dtype = dataset.dtype
    stored = dataset.id.get_type()
    if dtype.kind == "V" and dataset.attrs.get("dtype") == "bfloat16":
        if stored.get_class() != h5py.h5t.OPAQUE or stored.get_size() != 2:
            return None
        dtype = np.dtype(tf.bfloat16.as_numpy_dtype)
    elif dtype.kind not in "biuf" or stored != h5py.h5t.py_create(dtype):
        # h5py converts a stored type NumPy lacks (an integer of 24 bits)
        # on read; the raw bytes would not mean the array.
        return None
    if (
        # On Windows a live map would lock the file against replacement.
        os.name == "nt"
        or dataset.file.driver != "sec2"
        or dataset.chunks is not None
        or dataset.size * dtype.itemsize < _MAP_AT_BYTES
    ):
        return None
    offset = dataset.id.get_offset()
    if offset is None:  # Allocated lazily: never written.
        return None
    path = dataset.file.filename
    try:
        # The file h5py has open, not another one renamed into its path
        # since (a cache that re-downloads, an atomic writer).
        opened = os.fstat(dataset.file.id.get_vfd_handle())
        named = os.stat(path)
        if (opened.st_dev, opened.st_ino) != (named.st_dev, named.st_ino):
            return None
        return np.memmap(
            path, dtype=dtype, mode="r", offset=offset, shape=dataset.shape
        )
    except (OSError, ValueError):
        # No mmap on this file system, or a file shorter than it says.
        return None


def is_file_array(value: Any) -> bool:
    """A NumPy array, or an h5py dataset (read only where it is sliced)."""
    if isinstance(value, np.ndarray):
        return True
    kind = type(value)
    return kind.__module__.startswith("h5py") and kind.__name__ == "Dataset"


def assign(variable: Any, value: Any):
    """Assigns a full value (each replica's component gets its block).

    In a replica step a value of the block's shape (an optimizer's update)
    is assigned to this replica's component as it is. Returns the value, as
    Keras' `assign` does.
    """
    placement = placements.of(variable)
    ctx = tf.distribute.get_replica_context()
    strategy = variable._value.distribute_strategy
    in_step = ctx is not None and ctx.strategy is strategy
    if not in_step and is_file_array(value):
        # From a file (`load_weights`, `from_preset`): only this process's
        # blocks become tensors.
        assign_blocks(variable, lambda r: placement.block(value, r))
        return value
    value = tf.convert_to_tensor(value, dtype=variable._value.dtype)
    if in_step:
        component = variable._value._get_on_device_or_primary()
        if tuple(value.shape) != tuple(placement.local_shape):
            replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
            value = placement.block(value, replica)
        component.assign(value)
        return value
    for r, component in zip(
        local_replicas(strategy), variable._value.values, strict=True
    ):
        component.assign(placement.block(value, r))
    return value


def assign_blocks(variable: Any, block_of) -> None:
    """Assigns each of this process's components `block_of(replica)`.

    Outside a replica step, one block at a time, never the full value;
    `replica` is a global id, as `layout.Placement.begin` takes.
    """
    inner = variable._value
    dtype = inner.dtype.as_numpy_dtype
    for r, component in zip(
        local_replicas(inner.distribute_strategy), inner.values, strict=True
    ):
        component.assign(np.ascontiguousarray(block_of(r), dtype=dtype))


def short_device_name(name: str) -> str:
    """`"cpu:0"` for a local device, as `keras.distribution` names them."""
    spec = tf.DeviceSpec.from_string(name if "/" in name else "/" + name)
    short = f"{(spec.device_type or 'cpu').lower()}:{spec.device_index or 0}"
    if spec.job not in (None, "localhost"):
        return f"/job:{spec.job}/task:{spec.task or 0}/{short}"
    return short


def block_numpy(variable: Any, replica: int) -> np.ndarray:
    """Stored block of this process's replica `replica` (tests, debugging)."""
    return variable._value.values[replica].numpy()
