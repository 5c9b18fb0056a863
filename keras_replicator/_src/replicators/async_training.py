"""Keras 3 `model.fit` / `evaluate` / `predict` loops for an AsyncReplicator.

Keras 3 dropped parameter-server training (keras-team/keras#18624): its
trainer calls `strategy.run` on the coordinator, which
`ParameterServerStrategy` refuses. The `trainer_loops` patch routes models
built under an `AsyncReplicator` here (its `keras_loops`):

* `fit` schedules `steps_per_epoch` `train_step`s per epoch on per-worker
  datasets, calls batch-end hooks in step order as steps finish, and reads
  the epoch's logs from the metric variables on the ps after every step ran.
* `evaluate` with `steps` schedules that many `test_step`s on the workers;
  without, it runs on the coordinator over the finite data (each example
  once). `predict` runs on the coordinator.

The `atomic_assign` patch makes Keras' `assign_add`/`assign_sub` atomic for
parameter-server variables.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_replicator._src.core import validation
from keras_replicator._src.replicators import async_data
from keras_replicator._src.replicators import async_errors
from keras_replicator._src.upstream import callbacks_module
from keras_replicator._src.upstream import pythonify_logs
from keras_replicator._src.upstream import sharded_variable

_FIT_UNSUPPORTED = ("validation_split", "class_weight", "sample_weight")


def fit(
    model,
    replicator,
    *,
    x=None,
    y=None,
    batch_size=None,
    epochs=1,
    verbose="auto",
    callbacks=None,
    validation_split=0.0,
    validation_data=None,
    shuffle=True,
    class_weight=None,
    sample_weight=None,
    initial_epoch=0,
    steps_per_epoch=None,
    validation_steps=None,
    validation_batch_size=None,
    validation_freq=1,
):
    """`model.fit` under an AsyncReplicator; see the module docstring.

    Raises ValueError if `steps_per_epoch` is missing or not a positive
    integer, an unsupported argument is set, or `x` is unusable.
    """
    model._assert_compile_called("fit")
    source = async_data.Source(x, y, batch_size, shuffle=shuffle)
    if steps_per_epoch is None:
        # `replicator.distribute(...)` of a known count: one pass an epoch.
        steps_per_epoch = source.steps_per_epoch
    _check_steps("steps_per_epoch", steps_per_epoch, "model.fit")
    for name in _FIT_UNSUPPORTED:
        value = locals()[name]
        if value is not None and not (name == "validation_split" and not value):
            raise ValueError(
                f"`{name}` is not supported under AsyncReplicator; put it in "
                f"the dataset instead. Received: {name}={value!r}"
            )
    _build(model, replicator, source)
    iterator = iter(source.per_worker_dataset(replicator))
    train_fn = _step_function(model, replicator, model.train_step)
    callbacks = _callback_list(
        callbacks, model, verbose, epochs, steps_per_epoch, history=True
    )
    model.stop_training = False
    callbacks.on_train_begin()
    epoch_logs = None
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        logs = _run_steps(
            replicator,
            train_fn,
            iterator,
            steps_per_epoch,
            callbacks.on_train_batch_begin,
            callbacks.on_train_batch_end,
        )
        epoch_logs = dict(model._get_metrics_result_or_logs(logs))
        if validation_data is not None and model._should_eval(
            epoch, validation_freq
        ):
            val_x, val_y, val_w = _unpack(validation_data)
            val_logs = evaluate(
                model,
                replicator,
                x=val_x,
                y=val_y,
                sample_weight=val_w,
                batch_size=validation_batch_size or batch_size,
                steps=validation_steps,
                callbacks=callbacks,
                return_dict=True,
                verbose=0,
            )
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    callbacks.on_train_end(logs=epoch_logs)
    return model.history


def evaluate(
    model,
    replicator,
    *,
    x=None,
    y=None,
    batch_size=None,
    verbose="auto",
    sample_weight=None,
    steps=None,
    callbacks=None,
    return_dict=False,
    **kwargs,
):
    """`model.evaluate` under an AsyncReplicator; see the module docstring.

    Raises ValueError if `steps` is not a positive integer, or is missing
    with an `input_fn`.
    """
    model._assert_compile_called("evaluate")
    kwargs.pop("_use_cached_eval_dataset", None)
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    source = async_data.Source(
        x, y, batch_size, sample_weight=sample_weight, shuffle=False
    )
    if steps is None and source.input_fn is not None:
        raise ValueError(
            "Under AsyncReplicator, `model.evaluate` of an `input_fn` needs "
            "`steps` (each worker's dataset repeats). Pass finite arrays or "
            "a tf.data.Dataset to evaluate every example exactly once. "
            "Received: steps=None"
        )
    if steps is not None:
        _check_steps("steps", steps, "model.evaluate")
    _build(model, replicator, source)
    callbacks = _callback_list(callbacks, model, verbose, 1, steps)
    callbacks.on_test_begin()
    model.reset_metrics()
    if steps is None:
        # On the coordinator, over the finite data: each example once.
        test_fn = tf.function(model.test_step)
        logs = {}
        for step, batch in enumerate(source.local_dataset()):
            callbacks.on_test_batch_begin(step)
            logs = test_fn(batch)
            callbacks.on_test_batch_end(step, pythonify_logs(logs))
    else:
        iterator = iter(source.per_worker_dataset(replicator))
        logs = _run_steps(
            replicator,
            _step_function(model, replicator, model.test_step),
            iterator,
            steps,
            callbacks.on_test_batch_begin,
            callbacks.on_test_batch_end,
        )
    logs = pythonify_logs(model._get_metrics_result_or_logs(logs))
    callbacks.on_test_end(logs)
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


def predict(
    model,
    replicator,
    *,
    x,
    batch_size=None,
    verbose="auto",
    steps=None,
    callbacks=None,
):
    """`model.predict` under an AsyncReplicator: on the coordinator, in order.

    Returns NumPy outputs, one row per example of `x`.
    """
    source = async_data.Source(x, None, batch_size, shuffle=False)
    _build(model, replicator, source)
    dataset = source.local_dataset()
    if steps is not None:
        dataset = dataset.take(steps)
    predict_fn = tf.function(model.predict_step)
    outputs = [
        tf.nest.map_structure(np.asarray, predict_fn(batch))
        for batch in dataset
    ]
    del verbose, callbacks  # No per-batch hooks for a local loop.
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *outputs)


def _check_steps(name, value, where):
    if not validation.is_int(value) or value < 1:
        raise ValueError(
            f"Under AsyncReplicator, `{where}` needs `{name}` as a positive "
            "integer: each worker iterates its dataset forever, so only a "
            "step count ends the loop. Pass it, or pass "
            "`replicator.distribute(examples, global_batch_size)` of a "
            "dataset whose number of examples is known (at least one "
            "global batch): an epoch is then one pass over them. "
            f"Received: {name}={value!r}"
        )


def _unpack(data):
    if isinstance(data, tuple) and len(data) in (2, 3):
        return (*data, None)[:3]
    return data, None, None


def _build(model, replicator, source):
    """Creates the model's, metrics' and optimizer's variables on the ps.

    Raises NotImplementedError if `variable_partitioner` sharded a trainable
    variable.
    """
    with replicator.scope():
        model._symbolic_build(data_batch=source.element_spec())
    for variable in model.trainable_variables:
        if isinstance(variable.value, sharded_variable.ShardedVariable):
            # Keras' train_step needs `variable.handle`, which a
            # ShardedVariable lacks (AttributeError deep in fit).
            raise NotImplementedError(
                "`variable_partitioner` sharded a trainable variable, and "
                "Keras 3's train_step cannot take gradients of a sharded "
                "variable yet. Use variable_partitioner=None with model.fit. "
                f"Received: sharded variable {variable.path!r} of shape "
                f"{tuple(variable.shape)}"
            )


def _step_function(model, replicator, step):
    """One scheduled step: the next batch of the worker, on its replicas."""

    def one_step(iterator):
        outputs = replicator.run(step, args=(next(iterator),))
        # Average the worker's replicas, as Keras' reduce_per_replica does.
        return tf.nest.map_structure(
            lambda v: replicator.reduce("MEAN", v, axis=None), outputs
        )

    return tf.function(one_step)


def _run_steps(replicator, function, iterator, steps, on_begin, on_end):
    """Schedules `steps` steps, then calls `on_end` as each one finishes."""
    coordinator = replicator.coordinator
    results = []
    with async_errors.clear_ps_errors(replicator.cluster_config):
        for step in range(steps):
            on_begin(step)
            results.append(coordinator.schedule(function, args=(iterator,)))
        logs = {}
        for step, result in enumerate(results):
            logs = async_errors.fetch_logs(result)
            on_end(step, logs)
        coordinator.join()
    return logs


def _callback_list(callbacks, model, verbose, epochs, steps, history=False):
    if isinstance(callbacks, callbacks_module.CallbackList):
        return callbacks
    return callbacks_module.CallbackList(
        callbacks,
        add_history=history,
        add_progbar=verbose != 0,
        verbose=verbose,
        epochs=epochs,
        steps=steps,
        model=model,
    )
