"""An optimizer's update of a large variable, compiled into one pass.

Keras' TensorFlow optimizers update a variable with a dozen elementwise ops
(Adam: two moments, a square, a root, a division, three assigns), each a
pass with a temporary of its size. In ModelParallel's step of a 16.8M MLP
over 2 processes (`benchmarks/transport.py`) they took 19 ms of 49, the
matmuls 17; under DataParallel each process updates all 16.8M.

Under `ModelParallel` each replica updates its own blocks
(`replica_mean._apply_with_blocks`); under DataParallel (one device's
convention: `fit`, `replicate`) each updates its own copy of a replicated
variable from the averaged gradients (`replica_mean._apply`). A block or
variable of at least `MIN_ELEMENTS` values is then updated by the
optimizer's own `update_step` traced into a `jit_compile=True` function:
one loop, no temporaries, Keras' formula and order. XLA may fuse a
multiply-add (FMA) or write `a / sqrt(b)` as `a * rsqrt(b)`, so a float32
value may differ in its last bit per step, as a sum in another order does.
(TensorFlow's fused `ResourceApplyAdam` computes `1 - beta_2` in float32,
1.3e-5 relative from Keras' constant for `beta_2=0.999`, so `v` drifts:
left out.)

Only `_ELEMENTWISE` optimizers by exact class (Adam, AdamW, SGD, RMSprop...;
not Lamb, Muon, Adafactor nor subclasses), float32/float64 variables and a
traced step take it; smaller values, sparse gradients, ZeRO-1's slices, the
user's own `strategy.run` (stock Keras' cross-replica update) and updates
under no replicator keep Keras' ops (a launch costs what it saves).
TensorFlow logs "Compiled cluster using XLA" once per process.
"""

from __future__ import annotations

import tensorflow as tf
from keras import optimizers
from keras.src.backend.tensorflow import optimizer as tf_optimizer

from keras_replicator._src import gradients
from keras_replicator._src.core import placements
from keras_replicator._src.patches import registry
from keras_replicator._src.sharding import optimizer_shards

KINDS = frozenset({"local", "multi_worker"})

# Blocks of at least this many values are updated by a compiled function
# (256 KB of float32).
MIN_ELEMENTS = 1 << 16

# Keras' optimizers whose update is elementwise (no norm or statistic over
# the variable, which a block could not compute as one device does), by
# exact class: a subclass may add ops XLA cannot compile.
_ELEMENTWISE = frozenset(
    {
        optimizers.Adadelta,
        optimizers.Adagrad,
        optimizers.Adam,
        optimizers.AdamW,
        optimizers.Adamax,
        optimizers.Lion,
        optimizers.Nadam,
        optimizers.RMSprop,
        optimizers.SGD,
    }
)
# XLA may keep a 16-bit value's intermediates in float32 where Keras' ops
# round after each op: 16-bit variables keep Keras' ops.
_DTYPES = frozenset({tf.float32, tf.float64})


def compiles(optimizer, gradient, variable) -> bool:
    """Whether `variable`'s update by `optimizer` is compiled.

    `variable` is what Keras' TensorFlow optimizer updates: the storage a
    Keras variable reads, here (`placements.local_reads`) this replica's
    block of a sharded one.
    """
    if type(optimizer) not in _ELEMENTWISE or tf.executing_eagerly():
        return False
    blocks = placements.reading_locally()
    if not blocks and not _replicated_update(optimizer):
        return False
    if tf.as_dtype(variable.dtype) not in _DTYPES:
        return False
    if not tf.is_tensor(gradient) or isinstance(gradient, tf.IndexedSlices):
        return False
    if not variable.shape.is_fully_defined() or (
        variable.shape.num_elements() < MIN_ELEMENTS
    ):
        return False
    index = optimizer._trainable_variables_indices.get(
        optimizer._var_key(variable)
    )
    if index is None:
        return False
    sharded = placements.of(optimizer._trainable_variables[index]) is not None
    return sharded if blocks else not sharded


def _replicated_update(optimizer) -> bool:
    """Whether a DataParallel replica updates its own copy, averaged first.

    `patches/replica_mean.py` averaged the gradients (the optimizer's sum is
    off) and each replica updates its copy in replica context. ZeRO-1's
    slices keep Keras' ops.
    """
    return (
        gradients.sum_is_off(optimizer)
        and not tf.distribute.in_cross_replica_context()
        and not optimizer_shards.is_sharded(optimizer)
    )


def _distributed_tf_update_step(
    original, self, distribution, grads_and_vars, learning_rate
):
    grads_and_vars = list(grads_and_vars)
    compiled = [compiles(self, g, v) for g, v in grads_and_vars]
    if not any(compiled):
        return original(self, distribution, grads_and_vars, learning_rate)
    stock = [
        gv for gv, c in zip(grads_and_vars, compiled, strict=True) if not c
    ]
    if stock:
        original(self, distribution, stock, learning_rate)

    def update(var, grad, learning_rate):
        # A function per block (its own variables captured), compiled when
        # the step first runs.
        @tf.function(jit_compile=True, autograph=False)
        def step():
            self.update_step(grad, var, learning_rate)

        return step()

    for (grad, var), c in zip(grads_and_vars, compiled, strict=True):
        if c:
            # As stock Keras calls `update_step` (here in replica context:
            # the replica's own block).
            distribution.extended.update(
                var, update, args=(grad, learning_rate), group=False
            )


PATCH = registry.register(
    registry.Patch(
        name="compiled_updates",
        targets=(
            registry.Target(
                tf_optimizer.TFOptimizer,
                "_distributed_tf_update_step",
                _distributed_tf_update_step,
            ),
        ),
        applies_to=KINDS,
        pins=(
            registry.Pin(
                "keras.src.backend.tensorflow.optimizer",
                (
                    "def _distributed_tf_update_step(",
                    "return self.update_step(grad, var, learning_rate)",
                    "for grad, var in grads_and_vars:",
                ),
            ),
            # `compiles` finds the Keras variable of an update's storage.
            registry.Pin(
                "keras.src.optimizers.base_optimizer",
                (
                    "self._trainable_variables = variables[:]",
                    "return self._trainable_variables_indices["
                    "self._var_key(variable)]",
                ),
            ),
        ),
        delete_when=(
            "Keras' TensorFlow backend compiles optimizer updates, or "
            "implements `keras.distribution` (keras-team/keras#18473)"
        ),
    )
)
