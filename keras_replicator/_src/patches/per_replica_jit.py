"""`jit_compile=True` on several replicas: XLA compiles each replica's step.

Under a replicator with two or more CPU replicas, `fit`/`evaluate` of a
model compiled with `jit_compile=True` failed on its first step with

    Trying to access resource ... located in device CPU:1 from device CPU:0

Keras 3.15's `TensorFlowTrainer._make_function`
(`keras/src/backend/tensorflow/trainer.py`) wraps the WHOLE step, its
`strategy.run` over every replica included, in `tf.function(...,
jit_compile=self.jit_compile)`: one XLA cluster on CPU:0, whose resources
must all live there (`GetVariableInfosFromInputs` in
`tensorflow/compiler/jit/variable_info_util.cc`); replica 1's live on CPU:1.
Predict has no such problem: it compiles the predict step alone, inside
`strategy.run`. Under `MultiWorkerReplicator` the cluster also holds the
gradients' collective all-reduce, so one replica per worker fails too
(`UnimplementedError` on CPU).

The fix does as predict does. For a non-eager `jit_compile=True` model under
our replicators with more than one replica in sync, the outer step is built
with `jit_compile=False` and calls, inside `strategy.run`, a
`tf.function(jit_compile=True)` of the replica's forward pass, loss,
gradients and metric updates. The optimizer's `apply` all-reduces (a
`merge_call` and collectives, which XLA cannot hold), so while the compiled
step is traced `apply` only records its arguments; the compiled function
returns the gradients and the real `apply` runs right after, in the same
replica context, outside XLA. The arithmetic is the stock step's, up to
XLA's fusion (float rounding).

A step may call `apply` once: deferring two (a GAN's) would let the second
gradient see pre-update weights, so it gets a `ValueError` saying to use
`jit_compile=False`. Only optimizers held as model attributes
(`model.optimizer`, `model.g_optimizer`) are deferred. Other cross-replica
traffic in the step (synchronized batch norm, `all_reduce`, another
optimizer's `apply`) gets a `RuntimeError` saying the same.

Everything else takes the stock `_make_function`. Composed here, as this
patch owns `_make_function`, under our in-graph replicators:

- every train and test step is marked a Keras step
  (`core/replica_step.keras_step`), which decides its gradient convention;
- Keras 3.16 (3.16.0.dev nightlies) reads a one-step execution's batch
  eagerly (`iterator.get_next_as_optional()`) and traces the step on each
  replica's own shapes: on an uneven last batch the replicas trace different
  programs (a static batch, none, or an empty replica's 0, whose loss is
  Keras' empty vector and its mean NaN) and disagree on their collectives.
  As Keras 3.10 to 3.15 do, the batch is read inside the traced function
  (`_batch_in_graph`): each replica traced once, on the dataset's spec.

`PATCH.pins` records the exact Keras source lines this relies on;
`tests/test_patches.py` fails when a Keras upgrade changes them.
"""

from __future__ import annotations

import functools
import logging

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer

from keras_replicator._src import upstream
from keras_replicator._src.core import placements
from keras_replicator._src.core import replica_step
from keras_replicator._src.core import traits
from keras_replicator._src.core import versions
from keras_replicator._src.patches import registry

# The Keras source lines this module relies on, by module.
_KERAS_SOURCE_LINES = {
    # Train and test functions come from `_make_function`, which jit-compiles
    # the whole `strategy.run` (replaced here); predict jit-compiles its step
    # alone and calls it inside `strategy.run` (left as it is).
    "keras.src.backend.tensorflow.trainer": (
        "self.train_function = self._make_function(self.train_step)",
        "self.test_function = self._make_function(self.test_step)",
        "outputs = self.distribute_strategy.run(step_function, args=(data,))",
        "jit_compile=self.jit_compile,",
        "self.optimizer.apply_gradients(zip(gradients, trainable_weights))",
        "if not self.run_eagerly and self.jit_compile:",
        "one_step_on_data, reduce_retracing=True, jit_compile=True",
        "one_step_on_data, args=(data,)",
    ),
    # `jit_compile` is a property over `_jit_compile`, which `_make_function`
    # sets for the duration of the stock call.
    "keras.src.trainers.trainer": ("return self._jit_compile",),
    # `apply_gradients` goes through `self.apply`, which the compiled step
    # intercepts.
    "keras.src.optimizers.base_optimizer": (
        "self.apply(grads, trainable_variables)",
    ),
}

_COLLECTIVE_IN_XLA = (
    "With `jit_compile=True` on several replicas, XLA compiles each "
    "replica's step on that replica's device, so the compiled step cannot "
    "communicate across replicas; only `apply` of the optimizers the model "
    "holds as attributes (`model.optimizer`, or e.g. a GAN's "
    "`self.g_optimizer`) is moved out of it. This step ran a cross-replica "
    "all-reduce (a `merge_call`) inside it: `BatchNormalization("
    "synchronized=True)`, `CrossReplicaBatchNormalization`, `all_reduce` "
    "in a custom step, or an optimizer the model does not hold. Compile "
    "the model with `jit_compile=False`."
)
_MISSING = object()


def _make_function(original, self, step_function):
    if not traits.is_in_graph(self.distribute_strategy):
        return original(self, step_function)
    # Every train/test step Keras starts is a Keras step, whatever the
    # `train_step` (`patches/replica_mean.py`'s convention).
    step_function = replica_step.keras_step(step_function)
    if _wants_sharded_jit(self):
        scoped = _in_jit_scope(step_function)
        return _with_jit_off(
            self, lambda: _batch_in_graph(self, original(self, scoped), scoped)
        )
    if not _wants_per_replica_jit(self):
        return _batch_in_graph(
            self, original(self, step_function), step_function
        )
    # The stock function reads `self.jit_compile` once, when it wraps the
    # outer step in its tf.function: make that one a plain graph.
    compiled = _compile_per_replica(self, step_function)
    return _with_jit_off(
        self, lambda: _batch_in_graph(self, original(self, compiled), compiled)
    )


def _batch_in_graph(model, function, step_function):
    """`function`, reading a one-step execution's batch in its graph.

    For a distributed iterator and `steps_per_execution=1` on Keras 3.16
    (see the module docstring), runs Keras 3.15's one step:
    `iterator.get_next()` in a `tf.function`, then Keras' `one_step_on_data`,
    each replica traced on the dataset's spec; the data's end is Keras'
    `OutOfRangeError` (the epoch's end). Otherwise, and on Keras 3.10 to
    3.15 or eagerly, `function` as it is.
    TODO: delete when Keras' one-step execution reads the batch in the
    graph again, or traces it on the dataset's spec.
    """
    if versions.keras_before("3.16.0.dev0") or model.run_eagerly:
        return function
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(step_function, args=(data,))
        return tf_trainer.reduce_per_replica(outputs, strategy, "auto")

    # As Keras' own: the whole step is XLA when `jit_compile` is still set
    # here (one replica; several are compiled per replica, above).
    one_step_on_data = model._autoconvert_optionals(
        tf.function(
            one_step_on_data,
            reduce_retracing=True,
            jit_compile=model.jit_compile,
        )
    )

    @tf.function(reduce_retracing=True)
    @tf.autograph.experimental.do_not_convert
    def one_step_on_iterator(iterator):
        return one_step_on_data(iterator.get_next())

    def batch_in_graph(iterator):
        if model.steps_per_execution == 1 and isinstance(
            iterator, tf.distribute.DistributedIterator
        ):
            return one_step_on_iterator(iterator)
        return function(iterator)

    return batch_in_graph


def _wants_sharded_jit(model) -> bool:
    """`jit_compile=True` for a model `ModelParallel` stores in blocks."""
    return (
        bool(model.jit_compile)
        and not model.run_eagerly
        and placements.any_sharded(model.variables)
    )


def _with_jit_off(model, build):
    """`build()` with the stock code seeing `jit_compile=False`."""
    saved = model._jit_compile
    model._jit_compile = False
    try:
        return build()
    finally:
        model._jit_compile = saved


_SHARDED_JIT_NOTE = (
    "keras-replicator: `jit_compile=True` under `ModelParallel` compiles "
    "each device's share of the step with XLA: TensorFlow clusters the "
    "step's operations per device. Left uncompiled: the collectives "
    "between devices (the row moves, gathers and sums of sharded "
    "products), any op XLA has no kernel for, and the ops of a "
    "`predict_step` your model overrides."
)
_noted = []


def _in_jit_scope(step_function):
    """`step_function`, its ops marked for XLA where XLA can take them.

    A sharded variable's product moves blocks between devices, which one XLA
    cluster (one device) cannot hold. So ops are created in
    `tf.xla.experimental.jit_scope`, and TensorFlow's
    `MarkForCompilationPass` clusters each run of marked ops on one device,
    leaving the collectives between them: XLA's arithmetic, as on one device
    with `jit_compile=True`.
    """

    @functools.wraps(step_function)
    def step_in_jit_scope(data):
        if not _noted:  # Once a process.
            _noted.append(True)
            logging.getLogger("keras_replicator").warning(_SHARDED_JIT_NOTE)
        with tf.xla.experimental.jit_scope(
            compile_ops=True, separate_compiled_gradients=False
        ):
            return step_function(data)

    return step_in_jit_scope


def _make_predict_function(original, self, force=False):
    if not (
        _wants_sharded_jit(self)
        and traits.is_in_graph(self.distribute_strategy)
        and (force or self.predict_function is None)
    ):
        return original(self, force)
    # Keras' predict step is jit-compiled whole; under ModelParallel it is
    # built uncompiled and `predict_step` marks its ops (below).
    return _with_jit_off(self, lambda: original(self, force))


def _predict_step(original, self, data):
    if _wants_sharded_jit(self) and not tf.executing_eagerly():
        return _in_jit_scope(lambda d: original(self, d))(data)
    return original(self, data)


def _wants_per_replica_jit(model) -> bool:
    strategy = model.distribute_strategy
    return (
        bool(model.jit_compile)
        and not model.run_eagerly
        # Not TPUs (everything is XLA there) nor parameter servers.
        and traits.is_in_graph(strategy)
        and strategy.num_replicas_in_sync > 1
    )


def _compile_per_replica(model, step_function):
    """`step_function` for `strategy.run`, with its replica part in XLA."""
    # What the latest trace of `xla_replica_step` saw: the optimizer and
    # variables of its deferred `apply`, or None. A trace happens inside the
    # call that needs it, and MirroredStrategy runs one replica's Python at a
    # time.
    traced = {}

    # XLA's errors name the function it compiles: "while converting
    # __inference_xla_replica_step_...".
    def xla_replica_step(data):
        applies = []
        patched = _intercept_apply(model, applies)
        try:
            with replica_step.compiled_step():
                logs = step_function(data)
        except RuntimeError as err:
            # TF's "`merge_call` called while defining a new graph or a
            # tf.function": something all-reduced inside the compiled step.
            if "merge_call" not in str(err):
                raise
            raise RuntimeError(_COLLECTIVE_IN_XLA) from err
        finally:
            _restore_apply(patched)
        if len(applies) > 1:
            raise ValueError(
                "With `jit_compile=True` on several replicas, a train step "
                "may call `optimizer.apply` (or `apply_gradients`) at most "
                "once: its all-reduce and update run after the compiled "
                "step, so a second call would compute its gradients from "
                "weights the first had not updated yet. Compile the model "
                "with `jit_compile=False` for such steps (for example a "
                "GAN's). Received: "
                f"{len(applies)} calls to `apply` in one step, by "
                f"{[type(opt).__name__ for opt, _, _ in applies]}"
            )
        if not applies:
            traced["apply"] = None
            return logs, ()
        optimizer, grads, variables = applies[0]
        traced["apply"] = (optimizer, variables)
        return logs, grads

    compiled = tf.function(
        xla_replica_step, reduce_retracing=True, jit_compile=True
    )

    @functools.wraps(step_function)
    def step_with_apply(data):
        # Called inside `strategy.run`: the XLA cluster of `compiled` is
        # placed on this replica's device.
        logs, grads = compiled(data)
        if traced["apply"] is not None:
            optimizer, variables = traced["apply"]
            # The all-reduce and the update, outside XLA. Auto control
            # dependencies order it after `compiled`'s reads of the weights.
            optimizer.apply(list(grads), variables)
        return logs

    return step_with_apply


def _intercept_apply(model, applies):
    """Makes `apply` of the model's optimizers record its arguments."""
    patched = []
    for optimizer in _optimizers_of(model):

        def record(grads, trainable_variables=None, _optimizer=optimizer):
            variables = trainable_variables
            applies.append(
                (
                    _optimizer,
                    list(grads),
                    None if variables is None else list(variables),
                )
            )

        saved = optimizer.__dict__.get("apply", _MISSING)
        # `object.__setattr__`: Keras' tracking has no business with it.
        object.__setattr__(optimizer, "apply", record)
        patched.append((optimizer, saved))
    return patched


def _restore_apply(patched):
    for optimizer, saved in patched:
        if saved is _MISSING:
            del optimizer.__dict__["apply"]
        else:
            object.__setattr__(optimizer, "apply", saved)


def _optimizers_of(model):
    """`model.optimizer` and any other optimizer the model holds directly.

    A custom `train_step` with its own optimizers (a GAN's `d_optimizer`
    and `g_optimizer`) keeps them as attributes of the model.
    """
    found = {}
    candidates = [getattr(model, "optimizer", None), *vars(model).values()]
    for value in candidates:
        if isinstance(value, keras.optimizers.Optimizer):
            found.setdefault(id(value), value)
    return list(found.values())


PATCH = registry.register(
    registry.Patch(
        name="per_replica_jit",
        targets=(
            registry.Target(
                upstream.TensorFlowTrainer, "_make_function", _make_function
            ),
            registry.Target(
                upstream.TensorFlowTrainer,
                "make_predict_function",
                _make_predict_function,
            ),
            registry.Target(
                upstream.TensorFlowTrainer, "predict_step", _predict_step
            ),
        ),
        applies_to=frozenset({"local", "multi_worker"}),
        pins=(
            *(
                registry.Pin(module, lines)
                for module, lines in _KERAS_SOURCE_LINES.items()
            ),
            # `_batch_in_graph` replaces Keras 3.16's eager read of a
            # one-step execution's batch, and mirrors its `one_step_on_data`.
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                (
                    "if self.steps_per_execution == 1:",
                    "next_optional_inputs = iterator.get_next_as_optional()",
                    "return one_step_on_data(next_optional_inputs.get_value())",
                    'reduction="auto",',
                    "one_step_on_data = self._autoconvert_optionals("
                    "one_step_on_data)",
                ),
                attributes=(
                    "reduce_per_replica",
                    f"{upstream.TF_TRAINER}._autoconvert_optionals",
                ),
                keras=">=3.16.0.dev0",
            ),
        ),
        delete_when=(
            "Keras' `_make_function` jit-compiles each replica's step inside "
            "`strategy.run`, as `make_predict_function` does"
        ),
    )
)
