"""Keras variables that `keras.distribution.ModelParallel` stores sharded.

On JAX, Keras asks the distribution for a variable's layout at creation
(`backend/jax/core.py`); TensorFlow's backend builds a plain `tf.Variable`.
Here, under a `ModelParallel` distribution's replicator:

- `Variable._initialize` asks `distribution.get_variable_layout(variable)`;
  a layout splitting a dimension makes block storage (`sharding/sharded.py`)
  and is kept, so the optimizer slots `add_variable_from_reference` makes
  (`layout=reference._layout`) split alike (Keras 3.10 to 3.14 drop that
  `layout`: there `Variable.__init__` keeps it);
- `Variable.value` is, in a replica step, the value gathered from the blocks
  (its gradient reduced and cut back to the block); while an optimizer
  updates it (`core.placements.local_reads`), the replica's block; outside a
  step, the value assembled on the host, for `numpy()`, `get_weights`,
  `save_weights` and `model.save`;
- `Variable.handle` is the stored block's (what `GradientTape` watches);
- `Dense.call` and `EinsumDense.call` of a sharded kernel and its own bias
  add the bias in the product's op (`contraction.contract`), as one
  device's fused product adds it;
- `Variable._direct_assign` cuts a full value into blocks;
- `H5IOStore.__getitem__` is a read-only memory map of a `.weights.h5`
  value where one means it exactly (`sharded.mapped_dataset`), so loading
  reads this process's blocks, not Keras 3.12+'s whole NumPy copy;
- `TFOptimizer._var_key` keys a sharded variable by its storage;
- a SavedModel (`model.export`, `tf.saved_model.save`) is refused
  (`NotImplementedError`) by the variable's methods and, on Keras 3.16, by
  the export archive, which tracks each Keras variable's storage;
- `BaseOptimizer._clip_gradients` (`clipnorm`, `global_clipnorm`) takes the
  FULL gradients' norms (a block's squares summed over replicas once per
  copy), as on one device; `_backend_apply_gradients` says which are blocks.

Unsharded variables run the stock code, but a sync-on-read variable's
assignment in cross-replica context (each metric's reset) skips the value's
read-back, an all-reduce across workers. `PATCH.pins` records the lines.
"""

from __future__ import annotations

import contextlib
import threading

import h5py
import keras
import tensorflow as tf
from keras.src.backend.common import variables as common_variables
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.distribution import distribution_lib
from keras.src.optimizers import base_optimizer
from keras.src.saving import saving_lib

from keras_replicator._src import collectives
from keras_replicator._src import upstream
from keras_replicator._src.core import placements
from keras_replicator._src.core import versions
from keras_replicator._src.patches import registry
from keras_replicator._src.sharding import block_draw
from keras_replicator._src.sharding import contraction
from keras_replicator._src.sharding import sharded

KINDS = frozenset({"local", "multi_worker"})

_local = threading.local()


def _initialize(original, self, value):
    if isinstance(value, tf.Variable):
        return original(self, value)
    shape = self._shape
    if shape is None and not callable(value):
        shape = tuple(tf.convert_to_tensor(value).shape)
    if shape is None:
        return original(self, value)
    # Keras' layout lookup reads `variable.shape`; a variable initialised
    # from a value has none yet (`common/variables.py` sets it after).
    saved = self._shape
    self._shape = tuple(shape)
    try:
        strategy, placement, layout = sharded.sharding_strategy(self, shape)
    finally:
        self._shape = saved
    if placement is None:
        return original(self, value)
    self._value = sharded.create(self, value, placement, strategy)
    setattr(self, placements.ATTR, placement)
    if getattr(self, "_layout", None) is None:
        self._layout = layout
    return None


def _initialize_with_initializer(original, self, initializer):
    # The initializer itself, so that a sharded variable can draw its
    # blocks without the full value (`sharding/block_draw.py`).
    with block_draw.initializer_of(initializer):
        return original(self, initializer)


def _stateless(kind):
    def stateless(original, *args, **kwargs):
        return block_draw.stand_in(kind, original, *args, **kwargs)

    stateless.__name__ = f"stateless_{kind}"
    return stateless


def _init_keras_3_10(original, self, *args, layout=None, **kwargs):
    # Keras 3.10 to 3.14 drop `layout` (`KerasVariable.__init__` deletes
    # its kwargs); 3.15 keeps it as `_layout`, which `_initialize` above
    # sets, `add_variable_from_reference` passes on to the optimizer slots
    # and `ModelParallel.get_variable_layout` reads first.
    self._layout = layout
    original(self, *args, **kwargs)


def _value(original, self):
    if (
        placements.of(self) is None
        or self._value is None
        or placements.reading_locally()
    ):
        return original(self)
    if common_variables.in_stateless_scope():
        scope = common_variables.get_stateless_scope()
        if scope.get_current_value(self) is not None:
            return original(self)
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.strategy is self._value.distribute_strategy:
        return self._maybe_autocast(sharded.gathered(self, ctx))
    return self._maybe_autocast(sharded.full_value(self))


def _matmul(original, x1, x2):
    transposed = isinstance(x2, contraction.Transposed)
    variable = x2.variable if transposed else x2
    ctx = contraction.in_step(variable)
    if ctx is not None:
        equation = contraction.matmul_equation(x1, transposed)
        if equation and contraction.labels(equation, x1, variable):
            if transposed:

                def product(a, b):
                    return original(a, tf.transpose(b))

            else:
                product = original
            return contraction.contract(equation, x1, variable, ctx, product)
    if transposed:
        x2 = x2.tensor()
    return original(x1, x2)


def _einsum(original, subscripts, *operands, **kwargs):
    if len(operands) == 2 and not kwargs:
        x, variable = operands
        ctx = contraction.in_step(variable)
        if (
            ctx is not None
            and isinstance(subscripts, str)
            and contraction.labels(subscripts, x, variable)
        ):
            return contraction.contract(
                subscripts,
                x,
                variable,
                ctx,
                lambda a, b: original(subscripts, a, b),
            )
    return original(subscripts, *operands, **kwargs)


def _biased_call(original, self, inputs, training=None):
    # Stock `Dense.call`/`EinsumDense.call` (pinned) with a sharded kernel
    # and a bias of its own: the product adds the bias itself, in each block
    # (`contraction.contract`), then the activation as stock.
    kernel = getattr(self, "_kernel", None)
    bias = self.bias
    ctx = contraction.in_step(kernel)
    if (
        ctx is None
        or bias is None
        or placements.of(bias) is not None
        or getattr(self, "lora_enabled", False)
        or getattr(self, "quantization_mode", None)
    ):
        return original(self, inputs, training=training)
    einsum = isinstance(self, keras.layers.EinsumDense)
    equation = (
        self.equation if einsum else contraction.matmul_equation(inputs, False)
    )
    bias = tf.convert_to_tensor(bias)
    if (
        not equation
        or not tf.is_tensor(inputs)
        or inputs.dtype != bias.dtype
        or not contraction.labels(equation, inputs, kernel)
    ):
        return original(self, inputs, training=training)
    stock = registry.original(
        upstream.tf_numpy, "einsum" if einsum else "matmul"
    )
    x = contraction.contract(
        equation,
        inputs,
        kernel,
        ctx,
        (lambda a, b: stock(equation, a, b)) if einsum else stock,
        bias=bias,
    )
    return x if self.activation is None else self.activation(x)


def _take(original, x, indices, axis=None):
    if axis in (0, -2):
        ctx = contraction.in_step(x)
        if ctx is not None:
            found = contraction.lookup(x, indices, ctx)
            if found is not None:
                return found
    return original(x, indices, axis=axis)


def _transpose(original, x, axes=None):
    if (
        placements.of(x) is not None  # Only a sharded Keras variable.
        and len(x.shape) == 2
        and (axes is None or tuple(a % 2 for a in axes) == (1, 0))
        and contraction.in_step(x) is not None
    ):
        # Gathered only if something other than `matmul` reads it.
        return contraction.Transposed(x)
    return original(x, axes)


def _handle(original, self):
    if placements.of(self) is None:
        return original(self)
    return self._value.handle


def _direct_assign(original, self, value):
    if placements.of(self) is not None:
        return sharded.assign(self, value)
    stored = self._value
    if (
        isinstance(stored, tf.distribute.DistributedValues)
        and stored.synchronization == tf.VariableSynchronization.ON_READ
        and tf.distribute.in_cross_replica_context()
    ):
        # Keras' assign reads the value back: for a sync-on-read variable
        # (a metric's reset) an all-reduce across workers, then dropped.
        stored.assign(tf.cast(value, stored.dtype), read_value=False)
        return None
    return original(self, value)


def _assign(original, self, value):
    if placements.of(self) is None:
        return original(self, value)
    if (
        sharded.is_file_array(value)
        and tf.distribute.get_replica_context() is None
        and not common_variables.in_stateless_scope()
    ):
        # A value from a file (`load_weights`, `from_preset`): Keras would
        # make it a full tensor first; each block is cut from the array
        # (from an h5py dataset, which Keras before 3.12 passes, only the
        # block's bytes are read).
        if tuple(value.shape) != tuple(self.shape):
            raise ValueError(
                "The shape of the target variable and the shape of the "
                "target value in `variable.assign(value)` must match. "
                f"variable.shape={self.shape}, Received: "
                f"value.shape={value.shape}. Target variable: {self}"
            )
        return sharded.assign(self, value)
    if not placements.reading_locally():
        return original(self, value)
    # An optimizer's own update of a block (Keras' gradient accumulators:
    # `g_acc.assign(g + acc_g)`): Keras' check compares with the full shape.
    return sharded.assign(self, value)


def _shared_name(original, self):
    if placements.of(self) is None:
        return original(self)
    return self._value._shared_name


def _serialize_to_tensors(original, self):
    if placements.of(self) is None:
        return original(self)
    # `tf.train.Checkpoint` writes the whole value, as Keras' files do.
    return {"VARIABLE_VALUE": sharded.full_value(self)}


def _restore_from_tensors(original, self, restored_tensors):
    if placements.of(self) is None:
        return original(self, restored_tensors)
    return sharded.assign(self, restored_tensors["VARIABLE_VALUE"])


def _no_saved_model(name):
    def refuse(original, self, *args, **kwargs):
        if placements.of(self) is None:
            return original(self, *args, **kwargs)
        raise _saved_model_refused(self)

    refuse.__name__ = name
    return refuse


def _saved_model_refused(variable) -> NotImplementedError:
    return NotImplementedError(
        "Exporting a SavedModel (`model.export`, `tf.saved_model.save`) "
        "of variables sharded by `keras.distribution.ModelParallel` is "
        "not supported; save with `model.save` or `save_weights` (whole "
        "values) and export from a model loaded on one device. "
        f"Received: variable path={variable.path!r}"
    )


def _export_track_layer(original, self, layer):
    # Keras 3.16's archive would track each variable's storage: a sharded
    # one's is its blocks, which a SavedModel would hold as one block.
    for variable in layer.variables:
        if placements.of(variable) is not None:
            raise _saved_model_refused(variable)
    return original(self, layer)


def _export_convert_variable(original, self, backend_variable):
    # `ExportArchive.add_variable_collection`, which unwraps the same way.
    if placements.of(backend_variable) is not None:
        raise _saved_model_refused(backend_variable)
    return original(self, backend_variable)


def _var_key(original, self, variable):
    if placements.of(variable) is not None:
        variable = variable._value
    return original(self, variable)


@contextlib.contextmanager
def _clipping(variables):
    saved = getattr(_local, "variables", None)
    _local.variables = variables
    try:
        yield
    finally:
        _local.variables = saved


def _backend_apply_gradients(original, self, grads, trainable_variables):
    if not placements.any_sharded(trainable_variables):
        return original(self, grads, trainable_variables)
    with _clipping(list(trainable_variables)):
        return original(self, grads, trainable_variables)


def _clip_gradients(original, self, grads):
    variables = getattr(_local, "variables", None)
    clips = (self.clipnorm and self.clipnorm > 0) or (
        self.global_clipnorm and self.global_clipnorm > 0
    )
    if not clips or variables is None or len(variables) != len(grads):
        return original(self, grads)
    squares = _squared_norms(grads, variables)
    if self.clipnorm and self.clipnorm > 0:
        return [
            None if g is None else _clip_to(g, s, self.clipnorm)
            for g, s in zip(grads, squares, strict=True)
        ]
    # Keras' `clip_by_global_norm`, with the full gradients' norm.
    use_norm = tf.sqrt(tf.add_n([s for s in squares if s is not None]))
    clip_norm = tf.cast(self.global_clipnorm, use_norm.dtype)
    scale = clip_norm * tf.minimum(1.0 / use_norm, 1.0 / clip_norm)
    scale = scale + (use_norm - use_norm)
    return [None if g is None else _scaled(g, scale) for g in grads]


def _values(g):
    """The numbers of a gradient: an `IndexedSlices`' rows, repeats kept."""
    return g.values if isinstance(g, tf.IndexedSlices) else g


def _scaled(g, factor):
    # As Keras' `v * scale`: an `IndexedSlices` becomes dense (its repeated
    # rows summed), and the optimizer then sees a dense gradient.
    return tf.convert_to_tensor(g) * tf.cast(factor, g.dtype)


def _squared_norms(grads, variables):
    """Each gradient's squared norm, as one device computes it."""
    # As `tf.clip_by_norm` and Keras' `global_norm` do, an
    # `IndexedSlices`' repeated rows count one by one.
    squares = [
        None if g is None else tf.reduce_sum(tf.square(_values(g)))
        for g in grads
    ]
    blocks = [
        i
        for i, (s, v) in enumerate(zip(squares, variables, strict=True))
        if s is not None and placements.of(v) is not None
    ]
    if blocks:
        ctx = tf.distribute.get_replica_context()
        (summed,) = collectives.all_reduce(
            ctx, "sum", [tf.stack([squares[i] for i in blocks])]
        )
        for j, i in enumerate(blocks):
            # Each block lives on `copies` replicas: the sum counts it so
            # many times (a power of two on usual meshes: exact).
            copies = placements.of(variables[i]).copies
            squares[i] = summed[j] / copies
    return squares


def _clip_to(g, l2sum, clip_norm):
    """`tf.clip_by_norm(g, clip_norm)` given the squared norm."""
    values = _values(g)
    l2sum = tf.cast(l2sum, values.dtype)
    pred = l2sum > 0
    l2sum_safe = tf.where(pred, l2sum, tf.ones_like(l2sum))
    l2norm = tf.where(pred, tf.sqrt(l2sum_safe), l2sum)
    clip_norm = tf.cast(clip_norm, values.dtype)
    clipped = values * clip_norm / tf.maximum(l2norm, clip_norm)
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(clipped, g.indices, g.dense_shape)
    return clipped


_Variable = upstream.tf_core.Variable
_Base = base_optimizer.BaseOptimizer
# Keras 3.10 to 3.14: a variable keeps the `layout` it is created with.
# TODO: delete when the oldest supported Keras is 3.15.
_LAYOUT_TARGETS = (
    (registry.Target(_Variable, "__init__", _init_keras_3_10),)
    if versions.keras_before("3.15")
    else ()
)

if versions.keras_before("3.16.0.dev0"):
    # Keras 3.10 to 3.15: the archive tracks the Keras variables, whose
    # SavedModel methods refuse.
    # TODO: delete when the oldest supported Keras is 3.16.
    _EXPORT_TARGETS = ()
else:
    # Keras 3.16 (nightly builds from 3.16.0.dev): it tracks their storage.
    from keras.src.backend.tensorflow import export as tf_export

    _EXPORT_TARGETS = (
        registry.Target(
            tf_export.SavedModelExportArchive,
            "_backend_track_layer",
            _export_track_layer,
        ),
        registry.Target(
            tf_export.SavedModelExportArchive,
            "_convert_to_tf_variable",
            _export_convert_variable,
        ),
    )


def _h5_value(original, self, key):
    """A file value as a memory map under `ModelParallel`, else as stock."""
    if not isinstance(
        distribution_lib.distribution(), distribution_lib.ModelParallel
    ):
        return original(self, key)
    # Keras' own checks (no links, no external data) where it has them.
    get = getattr(saving_lib, "safe_get_h5_dataset", None)
    group = self._h5_entry_group
    try:
        dataset = get(group, key) if get else group[key]
    except Exception:  # Stock raises its own error for it.
        return original(self, key)
    if not isinstance(dataset, h5py.Dataset):  # A group (Keras 3.10).
        return original(self, key)
    mapped = sharded.mapped_dataset(dataset)
    return original(self, key) if mapped is None else mapped


PATCH = registry.register(
    registry.Patch(
        name="sharded_variables",
        targets=(
            registry.Target(_Variable, "_initialize", _initialize),
            registry.Target(
                _Variable,
                "_initialize_with_initializer",
                _initialize_with_initializer,
            ),
            # A sharded variable's random initial value, drawn by blocks.
            registry.Target(
                tf.random, "stateless_uniform", _stateless("uniform")
            ),
            registry.Target(
                tf.random, "stateless_normal", _stateless("normal")
            ),
            registry.Target(
                tf.random,
                "stateless_truncated_normal",
                _stateless("truncated"),
            ),
            registry.Target(_Variable, "value", _value),
            registry.Target(_Variable, "handle", _handle),
            registry.Target(upstream.tf_numpy, "matmul", _matmul),
            registry.Target(upstream.tf_numpy, "einsum", _einsum),
            registry.Target(upstream.tf_numpy, "transpose", _transpose),
            registry.Target(keras.layers.Dense, "call", _biased_call),
            registry.Target(keras.layers.EinsumDense, "call", _biased_call),
            registry.Target(upstream.tf_numpy, "take", _take),
            registry.Target(_Variable, "_direct_assign", _direct_assign),
            registry.Target(_Variable, "assign", _assign),
            registry.Target(_Variable, "_shared_name", _shared_name),
            registry.Target(
                _Variable, "_serialize_to_tensors", _serialize_to_tensors
            ),
            registry.Target(
                _Variable, "_restore_from_tensors", _restore_from_tensors
            ),
            *(
                registry.Target(_Variable, name, _no_saved_model(name))
                for name in (
                    "_write_object_proto",
                    "_export_to_saved_model_graph",
                    "_copy_trackable_to_cpu",
                )
            ),
            registry.Target(saving_lib.H5IOStore, "__getitem__", _h5_value),
            registry.Target(tf_optimizer.TFOptimizer, "_var_key", _var_key),
            registry.Target(
                _Base, "_backend_apply_gradients", _backend_apply_gradients
            ),
            registry.Target(_Base, "_clip_gradients", _clip_gradients),
            *_LAYOUT_TARGETS,
            *_EXPORT_TARGETS,
        ),
        applies_to=KINDS,
        pins=(
            # `_biased_call` is their `call` where the kernel is sharded.
            registry.Pin(
                "keras.src.layers.core.dense",
                (
                    "x = ops.matmul(inputs, self.kernel)",
                    "x = ops.add(x, self.bias)",
                    "x = self.activation(x)",
                ),
            ),
            registry.Pin(
                "keras.src.layers.core.einsum_dense",
                (
                    "x = ops.einsum(self.equation, inputs, self.kernel)",
                    "x = ops.add(x, self.bias)",
                    "x = self.activation(x)",
                ),
            ),
            # `_h5_value` reads the store's current group of values.
            registry.Pin(
                "keras.src.saving.saving_lib",
                ("self._h5_entry_group = {}",),
            ),
            registry.Pin(
                f"{upstream.TF_OPS}.core",
                (
                    "def _initialize(self, value):",
                    "self._initialize(lambda: initializer(self._shape, "
                    "dtype=self._dtype))",
                    "return self.value.handle",
                    "self._value.assign(tf.cast(value, self._value.dtype))",
                    "return tf.convert_to_tensor(self.value, dtype=dtype, "
                    "name=name)",
                ),
                attributes=(
                    "Variable._maybe_autocast",
                    "Variable._map_aggregation",
                ),
            ),
            registry.Pin(
                "keras.src.backend.tensorflow.random",
                (
                    "return tf.random.stateless_normal(",
                    "return tf.random.stateless_uniform(",
                    "return tf.random.stateless_truncated_normal(",
                ),
            ),
            registry.Pin(
                "keras.src.backend.common.variables",
                (
                    "return self._maybe_autocast(self._value)",
                    "self._initialize(initializer)",
                ),
            ),
            registry.Pin(
                "keras.src.backend.common.variables",
                ("self._layout = layout",),
                keras=">=3.15",
            ),
            registry.Pin(
                "keras.src.backend.common.variables",
                ("**kwargs,", "del kwargs"),
                keras="<3.15",
            ),
            registry.Pin(
                "keras.src.optimizers.base_optimizer",
                (
                    'layout=getattr(reference_variable, "_layout", None),',
                    "grads = self._clip_gradients(grads)",
                    "self._backend_apply_gradients(grads, trainable_variables)",
                ),
            ),
            registry.Pin(
                "keras.src.backend.tensorflow.optimizer",
                ("return tf.clip_by_norm(values, self.clipnorm, axes)",),
            ),
            # Keras 3.16's archive tracks, and converts for
            # `add_variable_collection`, each variable's storage.
            registry.Pin(
                "keras.src.backend.tensorflow.export",
                (
                    "variables = [v._value for v in layer.variables]",
                    "return backend_variable._value",
                ),
                keras=">=3.16.0.dev0",
            ),
            registry.Pin(
                "keras.src.export.saved_model_export_archive",
                (
                    "self._backend_track_layer(resource)",
                    "tree.map_structure(self._convert_to_tf_variable, "
                    "variables)",
                ),
                keras=">=3.16.0.dev0",
            ),
        ),
        delete_when=(
            "Keras' TensorFlow backend implements `keras.distribution` "
            "(keras-team/keras#18473)"
        ),
    )
)
