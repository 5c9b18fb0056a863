"""The gradient convention of each update, decided by the API that runs it.

Code is written for one of two conventions of combining gradients:

- **One device's** (Keras' `fit`/`evaluate` with any `train_step`, and
  `replicate`/`wrap_optimizer`): a replica's loss is its own examples' mean,
  and the gradients are AVERAGED.
- **tf.distribute's** (the user's own `strategy.run` with `apply_gradients`):
  a replica's loss is its share of the global loss
  (`tf.nn.compute_average_loss(per_example_loss, global_batch_size)` divides
  by the GLOBAL batch), and the gradients are SUMMED. TensorFlow's tutorial
  "Custom training with tf.distribute.Strategy" and Keras' distribute tests
  rely on it.

Stock Keras 3.15 (TF backend) pre-divides every loss it reduces by the
replica count (`keras/src/losses/loss.py`: `scale_loss_for_distribution`, in
`Loss`, `compute_loss` and regularization losses) and always sums
(`keras/src/backend/tensorflow/optimizer.py`: `_all_reduce_sum_gradients`).
That breaks single-device code: a custom `train_step` logs loss / N; the sum
runs AFTER loss-scale unscaling and clipping (acting on partial gradients)
and INSIDE the `tf.cond` of gradient accumulation and EMA, whose
`merge_call` MirroredStrategy refuses; a `keras.losses.Loss` in a `step_fn`
with an averaging optimizer trains N times too slowly; a ragged last batch
(29 and 28 examples) weighs examples unequally.

The rule, per update at trace time from the running replica step
(`core/replica_step.py`), under `LocalReplicator` and `MultiWorkerReplicator`
only (other strategies, and none, run the originals):

1. **Keras and `replicate` steps** (one device's). Losses are not pre-divided
   (`scale_`/`unscale_loss_for_distribution` return their argument), so a
   custom step logs one device's number. Every optimizer averages the
   gradients once, at the START of `apply`, weighted by each replica's
   example count (carried in the gradients' pack), so unscaling, clipping,
   accumulation, weight decay and the update act on the global gradient;
   Keras' later sum is off. With equal gradients everywhere, each replica
   updates its own copy in replica context, as `MirroredStrategy` does on
   GPUs under XLA (`_use_merge_call()` False meanwhile, on this thread), so
   accumulation's and EMA's `tf.cond`s hold no `merge_call`. A wrapping
   optimizer (`LossScaleOptimizer`) keeps its stock cross-replica decision.
2. **The user's own `strategy.run`** (tf.distribute's). A plain optimizer
   runs stock Keras, bit for bit as under stock `MirroredStrategy`/
   `MultiWorkerMirroredStrategy` (divided losses, summed gradients); with no
   scaling helper seen, whether the loss was a share is unknowable, so it
   sums and logs so once. Where stock cannot trace the update (accumulation
   or EMA in a `tf.function`: a `merge_call` in a `tf.cond`) the same sum
   runs once before it. `ReplicatedOptimizer` (`wrap_optimizer`) averages,
   unless the step scaled a loss as a share (then it sums).
3. **TensorFlow's scaling helpers** (`tf.nn.compute_average_loss`,
   `tf.nn.scale_regularization_loss`, a user's call of Keras'
   `scale_loss_for_distribution`) mean "my share". In `strategy.run` their
   values are stock. In a one-device step the share becomes the replica's
   mean (times the replica count): its value in a Keras step, so it logs
   one device's number; only its gradient in a `replicate` step, whose
   outputs the user reduces. Averaging then sums the shares' gradients: one
   device's update, also when a share is added to a Keras loss (a
   `train_step` adding `scale_regularization_loss`); such a step averages
   its replicas equally (a share already carries its examples' weight).

The replicator's `gradient_reduction=` overrides the rule: `"mean"` treats
every step as one device's (rule 1, `strategy.run` too), `"sum"` as
tf.distribute's (stock Keras everywhere, `fit` too; a wrapped optimizer
sums).

`PATCH.pins` records the exact Keras and TensorFlow source lines this
relies on; `tests/test_patches.py` fails when an upgrade changes them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading

import tensorflow as tf
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.losses import loss as loss_module
from keras.src.optimizers import base_optimizer
from keras.src.optimizers import loss_scale_optimizer
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.ops import nn as tf_nn
from tensorflow.python.ops import nn_impl_distribute

from keras_replicator._src import gradients
from keras_replicator._src.core import placements
from keras_replicator._src.core import replica_step
from keras_replicator._src.patches import registry
from keras_replicator._src.sharding import optimizer_shards

_logger = logging.getLogger("keras_replicator")
_SUMMED_MESSAGE = (
    "keras-replicator: `%s.apply_gradients` ran inside `strategy.run` on "
    "%d replicas, and no loss of that step was scaled as a share "
    "(`tf.nn.compute_average_loss`, `tf.nn.scale_regularization_loss` or a "
    "`keras.losses.Loss`). As tf.distribute does, the replicas' gradients "
    "are SUMMED: right when each replica's loss is its share of the global "
    "loss (e.g. divided by the global batch size). If each replica's loss "
    'is the mean over its own batch, pass `gradient_reduction="mean"` to '
    "the replicator (or use `replicate` / `wrap_optimizer`) for one "
    'device\'s numbers; pass `gradient_reduction="sum"` to keep the sum '
    "without this message."
)
# Optimizer classes already told about the sum (the message is logged once
# per class and process).
_told: set[str] = set()

_lock = threading.Lock()
# `no_merge`: depth of leaf `apply` calls on this thread that update each
# replica's copies in replica context.
_local = threading.local()


def _active_step():
    """The running replica step under one of ours with several replicas."""
    step = replica_step.current()
    if step is None:
        return None
    strategy = tf.distribute.get_strategy()
    if not gradients.is_ours(strategy) or strategy.num_replicas_in_sync == 1:
        return None
    return step


def _scale(original, value):
    step = _active_step()
    if step is None:
        return original(value)
    if _called_by_keras():
        if gradients.one_device_convention(step):
            return value
        step.shares = True
        return original(value)
    # The user's own code scales a loss as its share (rule 3).
    return _share(step, original(value))


def _unscale(original, value):
    step = _active_step()
    if step is not None and gradients.one_device_convention(step):
        return value
    return original(value)


def _share_helper(original, *args, **kwargs):
    """`tf.nn.compute_average_loss` / `scale_regularization_loss`."""
    value = original(*args, **kwargs)
    step = _active_step()
    if step is None:
        return value
    return _share(step, value)


def _share(step, value):
    """Notes that `value` is a share of the global loss (rule 3).

    In a step of one device's convention the share becomes the replica's
    own mean, so that averaging the replicas gives one device's update. In
    a Keras step its value is multiplied by the replica count: what the
    step logs is then one device's number too. In a `replicate` step only
    its gradient is, and the value stays the share the user computed
    (`reduce="sum"` of it is the global loss, as in tf.distribute).
    """
    step.shares = True
    if not gradients.one_device_convention(step):
        return value
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if step.api == replica_step.KERAS:
        return value * tf.cast(replicas, value.dtype)

    @tf.custom_gradient
    def share(x):
        def grad(upstream):
            return upstream * tf.cast(replicas, upstream.dtype)

        return tf.identity(x), grad

    return share(value)


def _called_by_keras() -> bool:
    """Whether Keras itself (a `Loss`, `compute_loss`) called the scaling.

    Looked up while tracing: the first caller outside this package.
    """
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("keras_replicator.", "functools")):
            return module.startswith("keras.")
        frame = frame.f_back
    return False


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
        or not gradients.is_ours(ctx.strategy)
        or ctx.num_replicas_in_sync == 1
    ):
        optimizer_shards.check_stock_apply(self)
        return original(self, grads, trainable_variables)
    if gradients.is_fed(self):
        optimizer_shards.check_stock_apply(self)
        with _replica_local_updates(self), placements.local_reads():
            return original(self, grads, trainable_variables)
    step = replica_step.current()
    blocks = _block_mask(self, trainable_variables)
    if any(blocks):
        # ModelParallel's sharded variables: their gradients were averaged
        # and cut to this replica's block where they were read
        # (`sharding/sharded.py`).
        return _apply_with_blocks(
            original, self, grads, trainable_variables, blocks, step, ctx
        )
    if not gradients.one_device_convention(step, ctx.strategy):
        # tf.distribute's convention: stock Keras, which sums (rule 2).
        _tell_summed(self, step, ctx)
        optimizer_shards.check_stock_apply(self)
        if _stock_fails_in_graph(self):
            # Stock would `merge_call` inside a `tf.cond` and fail: the
            # same sum of the shares, once, before the update.
            grads = gradients.scaled_sum(list(grads), ctx, 1.0, None, None)
            with gradients.receiving_reduced(self):
                with _replica_local_updates(self):
                    return original(self, grads, trainable_variables)
        return original(self, grads, trainable_variables)
    sharded = optimizer_shards.is_sharded(self)
    # Sharded state saves memory: its large gradients are not packed.
    bucket_bytes = optimizer_shards.BUCKET_BYTES if sharded else None
    grads = gradients.mean_gradients(
        list(grads), ctx, bucket_bytes=bucket_bytes
    )
    with gradients.receiving_reduced(self), _replica_local_updates(self):
        if sharded:
            # Opt-in ZeRO-1: update this replica's slice, gather weights.
            return optimizer_shards.apply(
                original, self, grads, trainable_variables
            )
        return original(self, grads, trainable_variables)


def _block_mask(optimizer, trainable_variables):
    """For each variable, whether ModelParallel stores it in blocks."""
    if trainable_variables is None:
        trainable_variables = getattr(optimizer, "_trainable_variables", ())
    return [placements.of(v) is not None for v in trainable_variables or ()]


def _apply_with_blocks(
    original, optimizer, grads, trainable_variables, blocks, step, ctx
):
    """Averages the replicated variables' gradients only; updates blocks."""
    if not gradients.one_device_convention(step, ctx.strategy) or (
        gradients.gradient_reduction(ctx.strategy) == "sum"
    ):
        raise NotImplementedError(
            "A model with variables sharded by `keras.distribution."
            "ModelParallel` trains in Keras steps (`fit`, `train_on_batch`, "
            "a custom `train_step`); an optimizer update in your own "
            "`strategy.run`, or with `gradient_reduction='sum'`, is not "
            f"supported. Received: optimizer={type(optimizer).__name__}"
        )
    constrained = [
        v.path
        for v, b in zip(
            trainable_variables or optimizer._trainable_variables,
            blocks,
            strict=True,
        )
        if b and v.constraint is not None
    ]
    if constrained:
        # A constraint would see a block (a norm over a split axis would be
        # the block's norm).
        raise NotImplementedError(
            "Weight constraints on variables sharded by `keras.distribution."
            "ModelParallel` are not supported; leave them out of the layout "
            f"map or drop the constraint. Received: variables={constrained}"
        )
    grads = list(grads)
    if len(grads) != len(blocks):
        raise ValueError(
            f"Expected one gradient per variable ({len(blocks)}). "
            f"Received: {len(grads)} gradients"
        )
    replicated = [i for i, b in enumerate(blocks) if not b]
    averaged = gradients.mean_gradients([grads[i] for i in replicated], ctx)
    for i, g in zip(replicated, averaged, strict=True):
        grads[i] = g
    with gradients.receiving_reduced(optimizer):
        with _replica_local_updates(optimizer), placements.local_reads():
            return original(optimizer, grads, trainable_variables)


def _stock_fails_in_graph(optimizer) -> bool:
    """Whether stock Keras cannot trace `optimizer`'s update in a replica.

    Gradient accumulation and EMA overwriting update inside a `tf.cond`,
    whose stock cross-replica sum is a `merge_call` MirroredStrategy
    refuses in a graph ("`merge_call` called while defining a new graph").
    Eagerly, stock works (and accumulates each replica's own gradients).
    """
    if tf.executing_eagerly() or hasattr(optimizer, "inner_optimizer"):
        return False
    return bool(optimizer.gradient_accumulation_steps) or bool(
        optimizer.use_ema and optimizer.ema_overwrite_frequency
    )


def _tell_summed(optimizer, step, ctx):
    """Logs once per optimizer class when a sum may not be what was meant.

    Only for the user's own `strategy.run` step (with a record): an inner
    optimizer that a `LossScaleOptimizer` applies in a `merge_call` has
    none, and its wrapper already spoke for the step.
    """
    if gradients.gradient_reduction(ctx.strategy) != "auto":
        return
    if step is None or step.api != replica_step.TF_DISTRIBUTE or step.shares:
        return
    name = type(optimizer).__name__
    with _lock:
        if name in _told:
            return
        _told.add(name)
    _logger.warning(_SUMMED_MESSAGE, name, ctx.num_replicas_in_sync)


def _all_reduce_sum_gradients(original, self, grads_and_vars):
    if gradients.sum_is_off(self):
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
    # The scaling helpers' stock values (a share of the global loss).
    "tensorflow.python.ops.nn_impl_distribute": (
        "return math_ops.div_no_nan(loss, global_batch_size)",
        "return math_ops.reduce_sum(regularization_loss) / num_replicas",
    ),
    # Without merge_call, a replica-context update touches this replica's
    # copy only.
    "tensorflow.python.distribute.mirrored_strategy": (
        "def _replica_ctx_update(self, var, fn, args, kwargs, group):",
        "var = var._get_replica(replica_id)",
    ),
}

# Every module that exports the helpers: user code reaches them as `tf.nn.*`
# (v1 and v2 compat too), TensorFlow's own code through `nn`.
_HELPER_OWNERS = (
    nn_impl_distribute,
    tf_nn,
    tf.nn,
    tf.compat.v1.nn,
    tf.compat.v2.nn,
)
_HELPERS = ("compute_average_loss", "scale_regularization_loss")

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
            *(
                registry.Target(owner, name, _share_helper)
                for owner in dict.fromkeys(_HELPER_OWNERS)
                for name in _HELPERS
            ),
        ),
        applies_to=gradients.KINDS,
        pins=tuple(
            registry.Pin(module, lines)
            for module, lines in _KERAS_SOURCE_LINES.items()
        ),
        delete_when=(
            "Keras averages gradients once before clipping and accumulation "
            "in `fit` under tf.distribute and stops pre-dividing its losses "
            "(keras-team/keras: no issue filed yet)"
        ),
    )
)
