"""Optimizer state sharded over the replicas (ZeRO stage 1), opt-in.

Under `shard_optimizer_state=True` (`LocalReplicator`, `MultiWorkerReplicator`)
each replica keeps 1/N of every per-weight optimizer variable (Adam's slots,
SGD's momentum, accumulators): a flat shard of `ceil(size / N)` elements (the
last zero-padded), block `r` of its `flat_placement` on replica `r`. Keras'
hooks are `patches/shard_state.py`.

Per update (`replica_mean` calls `apply` in replica context, gradients averaged
once as in every Keras step): `clipnorm` / `global_clipnorm` clip the FULL
gradients (global norms); each replica runs the optimizer's unchanged `apply`
on its slice of every gradient and weight (a "shadow" variable of the shard's
shape), exact as on one device since `update_step`, weight decay, learning-rate
schedules and gradient accumulation act element by element; bucketed
all-gathers of the shards, per dtype, rebuild the weights, each replica
assigning its own copy (no `merge_call`).

The gradients' reduce-scatter is EMULATED: each gradient is all-reduced in
full (bucketed) and each replica slices its part. TensorFlow's
`CollectiveReduceScatterV2` has no CPU implementation (on TensorFlow 2.21:
"did not find collective implementation undef"); NCCL's on GPUs is unused,
as it cannot be tested here.

Checkpoints hold the full state (`save_own_variables` concatenates the
shards, `load_own_variables` splits), so they restore on any replica count,
sharded or not; under `MultiWorkerReplicator` both are collectives every
worker joins (`fit`'s callbacks do). Refused with a `ValueError` when the
optimizer is built: any class but `SUPPORTED`, `use_ema`,
`loss_scale_factor`, `LossScaleOptimizer`.
"""

from __future__ import annotations

import functools
import math
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_replicator._src import collectives
from keras_replicator._src.sharding import layout
from keras_replicator._src.sharding import sharded

# Exact classes (a subclass may override `update_step`), element by element
# and compared with one device by the tests. Per-weight state comes from
# `add_variable_from_reference`; other state (Nadam's `u_product`, the
# iteration count) is one scalar alike on every replica. Refused: `Lamb`
# (trust ratios), `Muon` (orthogonalised matrices), `Adafactor` (factored
# state), `ScheduleFreeAdamW` (not compared here).
SUPPORTED = (
    keras.optimizers.SGD,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.RMSprop,
    keras.optimizers.Adagrad,
    keras.optimizers.Adadelta,
    keras.optimizers.Adamax,
    keras.optimizers.Nadam,
    keras.optimizers.Ftrl,
    keras.optimizers.Lion,
)

# Collectives go out in buckets of this many bytes (`collectives.buckets`):
# a gradient or shard this large alone (all-reduced in place; gathered as its
# variable's value, no copy), smaller ones packed. One pack per dtype held a
# second copy of everything: at 4 replicas in `benchmarks/memory.py`, buckets
# cut peak RSS from about 1340 MB to about 1230 MB.
BUCKET_BYTES = 4 * 2**20

# optimizer -> its `_Shards`. Outside the optimizer, so that Keras' tracking
# does not add the shadows to `optimizer.variables` (which checkpoints save).
_SHARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Shards:
    """What a sharded optimizer knows about its shards."""

    def __init__(self, num_replicas):
        self.num_replicas = num_replicas
        # id(optimizer slot) -> its model variable's shape, for sharded slots.
        self.slots = {}
        # Model variable key -> its shadow (a weight shard).
        self.shadows = {}


def enabled(strategy) -> bool:
    """Whether `strategy` asks for sharded state over several replicas."""
    return (
        bool(getattr(strategy, "shard_optimizer_state", False))
        and strategy.num_replicas_in_sync > 1
    )


def is_sharded(optimizer) -> bool:
    """Whether `optimizer` was built with sharded state."""
    return optimizer in _SHARDS


def check_stock_apply(optimizer) -> None:
    """Refuses a sharded `optimizer`'s stock update (`ValueError`).

    Outside a one-device-convention replica step (the user's own
    `strategy.run`, `wrap_optimizer`, cross-replica context) it would pair the
    shards with full weights.
    """
    if is_sharded(optimizer):
        raise ValueError(
            "An optimizer with sharded state (`shard_optimizer_state=True`) "
            "updates only in Keras steps (`fit`, `train_on_batch`, a custom "
            "`train_step`) and `replicate` steps; not in your own "
            "`strategy.run`, under `wrap_optimizer`, or outside a replica "
            "step. Pass `shard_optimizer_state=False` for those. Received: "
            f"optimizer={type(optimizer).__name__}"
        )


def _on_read(next_creator, **kwargs):
    # Per-replica components that may differ: each holds its own slice.
    kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
    kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
    return next_creator(**kwargs)


def flat_placement(shape, num_replicas: int) -> layout.Placement:
    """Where a variable of `shape`'s flat shards live: one block storage.

    A `layout.Placement` like ModelParallel's, so `sharded.py` cuts, gathers
    and assigns both. Only the container differs: a `SyncOnRead` variable of
    shape `(k,)` the optimizer updates as its own, where ModelParallel's keeps
    its full shape (why: `docs/design.md`, "Block storage, probed").
    """
    size = int(np.prod(shape))
    k = max(1, math.ceil(size / num_replicas))
    return layout.Placement(
        path="",
        full_shape=(k * num_replicas,),
        mesh_shape=(num_replicas,),
        axis_names=("replica",),
        dim_axes=(0,),
        devices=tuple(f"replica:{r}" for r in range(num_replicas)),
    )


def _padded(value, placement):
    """`value` flattened and zero-padded to `placement`'s one dimension."""
    flat = tf.reshape(tf.convert_to_tensor(value), [-1])
    padding = placement.full_shape[0] - flat.shape[0]
    return tf.pad(flat, [[0, padding]]) if padding else flat


def _block(value, placement, replica_id):
    """This replica's flat shard of `value` (a static or traced id)."""
    flat = _padded(value, placement)
    if isinstance(replica_id, int):
        return placement.block(flat, replica_id)
    k = placement.local_shape[0]
    return tf.slice(flat, [replica_id * k], [k])


def check_supported(optimizer):
    if type(optimizer) not in SUPPORTED:
        names = tuple(c.__name__ for c in SUPPORTED)
        raise ValueError(
            "`shard_optimizer_state=True` supports the optimizers "
            f"{names} (their update is element by element and tested); "
            "others, such as `Adafactor` (factored state), `Lamb` "
            "(per-variable trust ratio), `Muon`, `LossScaleOptimizer` or a "
            "subclass, are not supported. Pass "
            "`shard_optimizer_state=False` to use it. Received: "
            f"optimizer={type(optimizer).__name__}"
        )
    for option in ("use_ema", "loss_scale_factor"):
        value = getattr(optimizer, option, None)
        if value:
            raise ValueError(
                f"`shard_optimizer_state=True` does not support `{option}` "
                "yet. Pass `shard_optimizer_state=False` to use it. "
                f"Received: {option}={value!r}"
            )


def build(original, optimizer, variables):
    """`optimizer.build(variables)` (the stock `original`), sharded if asked.

    Raises:
        ValueError: For an optimizer `SUPPORTED` lacks.
        RuntimeError: If it is built in a replica step.
    """
    strategy = getattr(optimizer, "_distribution_strategy", None)
    if not enabled(strategy) or optimizer in _SHARDS:
        return original(optimizer, variables)
    check_supported(optimizer)
    ctx = tf.distribute.get_replica_context()
    # Outside any scope the default replica context is not a replica step.
    if ctx is not None and ctx.strategy is strategy:
        raise RuntimeError(
            "An optimizer with sharded state (`shard_optimizer_state=True`) "
            "must be built before the replica step: call "
            "`optimizer.build(model.trainable_variables)` under "
            "`replicator.scope()` first (`fit` does it for you). It was "
            "built in a replica context."
        )
    shards = _Shards(strategy.num_replicas_in_sync)
    # Registered first: the subclass' `build` creates its slots (through
    # `add_variable_from_reference`) after this base `build` returns.
    _SHARDS[optimizer] = shards
    result = original(optimizer, variables)
    indices = optimizer._trainable_variables_indices
    with tf.init_scope(), strategy.scope(), tf.variable_creator_scope(_on_read):
        for variable in variables:
            placement = flat_placement(variable.shape, shards.num_replicas)
            shadow = keras.Variable(
                initializer="zeros",
                shape=placement.local_shape,
                dtype=variable.dtype,
                trainable=False,
                name=variable.name,
            )
            key = optimizer._var_key(variable)
            shards.shadows[key] = shadow
            # The shadow shares its model variable's slots.
            indices[optimizer._var_key(shadow)] = indices[key]
            if key in getattr(optimizer, "_exclude_from_weight_decay", ()):
                optimizer._exclude_from_weight_decay.add(
                    optimizer._var_key(shadow)
                )
    return result


def make_slot(optimizer, reference_variable, name=None, initializer="zeros"):
    """A sharded optimizer's slot for `reference_variable`: a flat shard."""
    shards = _SHARDS[optimizer]
    shape = tuple(reference_variable.shape)
    name = name or "var"
    if hasattr(reference_variable, "path"):
        name = f"{reference_variable.path.replace('/', '_')}_{name}"
    placement = flat_placement(shape, shards.num_replicas)
    with tf.init_scope(), tf.variable_creator_scope(_on_read):
        variable = optimizer.add_variable(
            shape=placement.local_shape,
            initializer=initializer,
            dtype=reference_variable.dtype,
            name=name,
        )
    shards.slots[id(variable)] = shape
    return variable


def apply(original, optimizer, grads, trainable_variables):
    """Updates `optimizer`'s shard by the stock `original`; gathers weights.

    In replica context, with averaged `grads` and replica-local updates on
    (`replica_mean._apply`). `trainable_variables` None: those the optimizer
    was built with.
    """
    shards = _SHARDS[optimizer]
    ctx = tf.distribute.get_replica_context()
    n = shards.num_replicas
    replica_id = ctx.replica_id_in_sync_group
    if tf.get_static_value(replica_id) is not None:
        replica_id = int(tf.get_static_value(replica_id))
    if trainable_variables is None:
        trainable_variables = optimizer._trainable_variables
    pairs = [
        (g, v)
        for g, v in zip(grads, trainable_variables, strict=True)
        if g is not None
    ]
    if not pairs:
        return original(optimizer, grads, trainable_variables)
    grads = [tf.convert_to_tensor(g) for g, _ in pairs]
    variables = [v for _, v in pairs]
    if optimizer.clipnorm or optimizer.global_clipnorm:
        # Global norms; the shards' own clipping in `original` is a no-op.
        grads = optimizer._clip_gradients(grads)
    shadows, grad_slices = [], []
    for g, v in zip(grads, variables, strict=True):
        shadow = shards.shadows[optimizer._var_key(v)]
        placement = flat_placement(v.shape, n)
        # Re-sliced every step: the shadow equals the weights even when
        # other code assigned them since.
        shadow.assign(_block(v.value, placement, replica_id))
        shadows.append(shadow)
        grad_slices.append(_block(g, placement, replica_id))
    original(optimizer, grad_slices, shadows)
    # One gather per bucket, each after the previous bucket's assignments:
    # a replica holds one bucket's gathered weights at a time.
    assigned = []
    sizes = [s.shape[0] * tf.as_dtype(s.dtype).size for s in shadows]
    for bucket in _gather_buckets(shadows, sizes):
        with tf.control_dependencies(assigned):
            fulls = _gather_bucket(ctx, [shadows[i] for i in bucket])
        assigned = []
        for i, full in zip(bucket, fulls, strict=True):
            assigned.append(_assign_full(ctx, variables[i], full))
    return None


def _gather_buckets(shadows, sizes):
    """`collectives.buckets` of the shadows, within each dtype."""
    out, start = [], 0
    for end in range(1, len(shadows) + 1):
        if end == len(shadows) or shadows[end].dtype != shadows[start].dtype:
            out.extend(
                [start + j for j in bucket]
                for bucket in collectives.buckets(
                    sizes[start:end], BUCKET_BYTES
                )
            )
            start = end
    return out


def _gather_bucket(ctx, shadows):
    """The full flat values of `shadows` (one dtype): one all-gather."""
    values = [tf.convert_to_tensor(s.value) for s in shadows]
    if len(values) == 1:
        # The gathered shards, in replica order, are the value: no copy.
        return [collectives.all_gather_equal(ctx, values[0])]
    lengths = [v.shape[0] for v in values]
    gathered = collectives.all_gather_equal(ctx, tf.concat(values, axis=0))
    # Row r is replica r's pack; a value's column block, read row by row,
    # is that value's shards in replica order.
    rows = tf.reshape(gathered, [ctx.num_replicas_in_sync, sum(lengths)])
    return [
        tf.reshape(column, [-1]) for column in tf.split(rows, lengths, axis=1)
    ]


def _assign_full(ctx, variable, full):
    """Assigns a gathered flat value; returns the op to wait for."""
    size = int(np.prod(variable.shape))
    if full.shape[0] != size:
        full = full[:size]
    done = _assign_own_copy(ctx, variable, tf.reshape(full, variable.shape))
    if variable.constraint is not None:
        with tf.control_dependencies([done]):
            constrained = variable.constraint(variable)
            done = _assign_own_copy(ctx, variable, constrained)
    return done


def _assign(component, value):
    return component.assign(value, read_value=False)


def _assign_own_copy(ctx, variable, value):
    """Assigns this replica's copy of `variable`, as Keras' updates do.

    Through `extended.update` (replica-local updates are on), so a weight
    with an `aggregation` is not summed or averaged over replicas. Returns
    the assign op the next gather waits for (Keras' `assign` returns its
    input).
    """
    return ctx.strategy.extended.update(
        variable.value, _assign, args=(value,), group=False
    )


def save_state(optimizer, store) -> None:
    """Keras' `save_own_variables`, every slot whole (an all-gather each)."""
    shards = _SHARDS[optimizer]
    for i, variable in enumerate(optimizer.variables):
        shape = shards.slots.get(id(variable))
        if shape is None:
            store[str(i)] = variable.numpy()
            continue
        placement = flat_placement(shape, shards.num_replicas)
        flat = sharded.blocks_value(variable._value, placement).numpy()
        store[str(i)] = flat[: int(np.prod(shape))].reshape(shape)


def load_state(optimizer, store) -> None:
    """Keras' `load_own_variables`: each replica takes its shard of a slot."""
    shards = _SHARDS[optimizer]
    for i, variable in enumerate(optimizer.variables):
        value = np.asarray(store[str(i)])
        shape = shards.slots.get(id(variable))
        if shape is None:
            variable.assign(value)
            continue
        if tuple(value.shape) != tuple(shape):
            raise ValueError(
                f"Optimizer variable {variable.path!r} has shape {shape}; "
                "the checkpoint holds another. Received: "
                f"shape={tuple(value.shape)}"
            )
        placement = flat_placement(shape, shards.num_replicas)
        flat = np.zeros(placement.full_shape, value.dtype)
        flat[: value.size] = value.reshape(-1)
        # Eagerly, block by block: nothing to trace, no collective.
        sharded.assign_blocks(
            variable, functools.partial(placement.block, flat)
        )
