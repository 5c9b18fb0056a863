"""`replicator.replicate(step_fn, input_fn)`: TF-Replicator's research loop.

`input_fn` builds one replica's data, `step_fn` its step. `replicate`
distributes the data (`distribute_datasets_from_function`) and compiles one
`tf.function` that runs `step_fn` on every replica (`steps_per_call` times in
a `tf.while_loop`) and reduces over all replicas and workers: one host round
trip per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from keras_replicator._src.core import replica_step
from keras_replicator._src.core import validation
from keras_replicator._src.core.types import TensorTree
from keras_replicator._src.training import hang_watchdog

REDUCTIONS = ("mean", "sum", None)

InputFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]
StepFn = Callable[[Any], TensorTree]


class ReplicatedStep:
    """A compiled step of every replica; call it to advance them all.

    Made by `replicator.replicate`. Each call runs `step_fn`
    `steps_per_call` times on every replica's next batches and returns the
    last step's outputs.

    Attributes:
        strategy: The replicator (a `tf.distribute.Strategy`) it runs on.
        dataset: The distributed dataset made from `input_fn`.
        reduce: `"mean"`, `"sum"` or None, as given.
        steps_per_call: Steps per call, as given.
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        step_fn: StepFn,
        input_fn: InputFn,
        reduce: str | None = "mean",
        steps_per_call: int = 1,
    ):
        _validate(step_fn, input_fn, reduce, steps_per_call)
        self.strategy = strategy
        self.reduce = reduce
        self.steps_per_call = steps_per_call
        self._step_fn = step_fn
        self.dataset = strategy.distribute_datasets_from_function(
            _checked_input_fn(input_fn)
        )
        self._iterator = iter(self.dataset)
        self._function = tf.function(self._run)
        # The hang watchdog times each call, not the time between calls.
        self._watch = hang_watchdog.StepWatch(strategy)

    def __call__(self) -> TensorTree | list[TensorTree] | None:
        """Advances every replica by `steps_per_call` steps.

        Returns:
            The last step's outputs of `step_fn`: with `"mean"` or `"sum"`,
            reduced over every replica of every worker (the same value on
            every worker; integers become float under `"mean"`, see
            `replicate`); with `reduce=None`, a list of one output per local
            replica, in order. None leaves (or a None output) stay None.

        Raises:
            tf.errors.OutOfRangeError: If `input_fn`'s dataset ran out
                (make it repeat for open-ended loops).
            TypeError: On the first call, if `reduce` is set and an output
                is not numeric (e.g. `bool`).
        """
        with self._watch:
            outputs = self._function(self._iterator)
        if self.reduce is None and outputs is not None:
            return list(outputs)
        return outputs

    def _run(self, iterator):
        outputs = self._one_step(iterator)
        if self.steps_per_call == 1:
            return outputs
        # A tf.while_loop keeps the graph one step big; it carries the
        # reduced (or per-replica local) outputs.
        if outputs is None:
            tf.while_loop(
                lambda i: i < self.steps_per_call,
                lambda i: _after(self._one_step(iterator), i + 1),
                (tf.constant(1),),
            )
            return None
        # tf.while_loop rejects None ("None values not supported"): carry
        # only tensors and put None leaves back after.
        flat = tf.nest.flatten(outputs)
        kept = [i for i, value in enumerate(flat) if value is not None]

        def body(i, _):
            latest = tf.nest.flatten(self._one_step(iterator))
            return i + 1, [latest[j] for j in kept]

        _, carried = tf.while_loop(
            lambda i, _: i < self.steps_per_call,
            body,
            (tf.constant(1), [flat[j] for j in kept]),
        )
        for j, value in zip(kept, carried, strict=True):
            flat[j] = value
        return tf.nest.pack_sequence_as(outputs, flat)

    def _one_step(self, iterator):
        per_replica = self.strategy.run(
            self._replica_fn, args=(next(iterator),)
        )
        if all(v is None for v in tf.nest.flatten(per_replica)):
            return None
        if self.reduce is None:
            return _local_results(self.strategy, per_replica)
        # Reducing in the function adds a collective, not a round trip.
        op = self.reduce.upper()
        return tf.nest.map_structure(
            lambda v: (
                None if v is None else self.strategy.reduce(op, v, axis=None)
            ),
            per_replica,
        )

    @functools.cached_property
    def _replica_fn(self):
        """`_replica_step`, marked as a TF-Replicator step for `run`.

        Optimizers in `step_fn` then follow one device's gradient convention
        (`patches/replica_mean.py`).
        """

        def replica_fn(batch):
            return self._replica_step(batch)

        return replica_step.mark(replica_fn, replica_step.REPLICATOR)

    def _replica_step(self, batch):
        """One replica's `step_fn`, with outputs ready to be reduced."""
        outputs = self._step_fn(batch)
        if self.reduce is None:
            return outputs
        return _reducible(outputs, self.reduce)


def replicate(
    strategy: tf.distribute.Strategy,
    step_fn: StepFn,
    input_fn: InputFn,
    reduce: str | None = "mean",
    steps_per_call: int = 1,
) -> ReplicatedStep:
    """Compiles `step_fn` over every replica of `strategy`, fed by `input_fn`.

    See `ReplicatorMixin.replicate`, which calls this with itself.

    `reduce="mean"` divides with `tf.math.truediv`, as `strategy.reduce
    ("MEAN", ...)` does over several replicas: integers become `float32` (8
    and 16 bits) or `float64` (32, 64), for any replica count (plain
    `strategy.reduce` keeps them integer on one replica). They are cast
    before the all-reduce, so the sum cannot overflow. `"sum"` keeps the
    dtype. None leaves stay None in every mode.

    Args:
        strategy: The replicator to run on.
        step_fn: One replica's step, called with that replica's batch.
        input_fn: Called with a `tf.distribute.InputContext` once per
            worker's pipeline; returns a `tf.data.Dataset` of per-replica
            batches.
        reduce: `"mean"`, `"sum"` or None. Defaults to `"mean"`.
        steps_per_call: Steps per call. Defaults to 1.

    Returns:
        A `ReplicatedStep`: call it to advance every replica.

    Raises:
        TypeError: If `step_fn` or `input_fn` is not callable or `input_fn`
            returns no `tf.data.Dataset`; on the step's first call, if
            `reduce` is set and an output is not numeric.
        ValueError: If `reduce` or `steps_per_call` is not supported.
    """
    return ReplicatedStep(strategy, step_fn, input_fn, reduce, steps_per_call)


def _validate(step_fn, input_fn, reduce, steps_per_call) -> None:
    if not callable(step_fn):
        raise TypeError(
            "`step_fn` must be a callable that takes one replica's batch. "
            f"Received: step_fn={step_fn!r} of type {type(step_fn).__name__}"
        )
    if not callable(input_fn):
        raise TypeError(
            "`input_fn` must be a callable that takes a "
            "`tf.distribute.InputContext` and returns a `tf.data.Dataset`. "
            f"Received: input_fn={input_fn!r} of type "
            f"{type(input_fn).__name__}"
        )
    if reduce not in REDUCTIONS:
        raise ValueError(
            f"`reduce` must be one of {REDUCTIONS}. Received: reduce={reduce!r}"
        )
    validation.check_positive_int("steps_per_call", steps_per_call)


def _checked_input_fn(input_fn: InputFn) -> InputFn:
    """Wraps `input_fn` to fail early, by name, when it returns no Dataset."""

    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        dataset = input_fn(ctx)
        if not isinstance(dataset, tf.data.Dataset):
            name = getattr(input_fn, "__name__", repr(input_fn))
            raise TypeError(
                f"`input_fn` must return a `tf.data.Dataset` of per-replica "
                f"batches. Received: {name}(ctx) returned {dataset!r} of type "
                f"{type(dataset).__name__}"
            )
        return dataset

    return dataset_fn


def _reducible(outputs: TensorTree, reduce: str) -> TensorTree:
    """Checks outputs are numeric (else TypeError); casts ints for "mean"."""
    tensors = tf.nest.map_structure(_as_tensor, outputs)
    dtypes = [v.dtype for v in tf.nest.flatten(tensors) if v is not None]
    if not all(d.is_integer or d.is_floating or d.is_complex for d in dtypes):
        received = tf.nest.map_structure(
            lambda v: None if v is None else v.dtype.name, tensors
        )
        raise TypeError(
            f"`reduce={reduce!r}` needs numeric outputs (integer, floating "
            "point or complex) from `step_fn`; cast the others in `step_fn` "
            "(e.g. `tf.cast(flag, tf.int32)`), or use reduce=None to get "
            f"every replica's value. Received: output_dtypes={received}"
        )
    if reduce != "mean":
        return tensors
    return tf.nest.map_structure(_mean_dtype, tensors)


def _as_tensor(value):
    """Numbers and arrays as tensors; tensors (sparse too) as they are."""
    if value is None or tf.is_tensor(value):
        return value
    return tf.convert_to_tensor(value)


def _mean_dtype(value: tf.Tensor | None) -> tf.Tensor | None:
    """Casts an integer tensor to the float `tf.math.truediv` would give."""
    if value is None or not value.dtype.is_integer:
        return value
    # tf.math.truediv's own rule: float32 up to 16 bits, float64 above.
    dtype = tf.float32 if value.dtype.size <= 2 else tf.float64
    return tf.cast(value, dtype)


def _local_results(strategy, per_replica) -> tuple:
    """Splits per-replica values into one nest per local replica (None kept)."""
    flat = tf.nest.flatten(per_replica)
    replicas = len(
        strategy.experimental_local_results(
            next(v for v in flat if v is not None)
        )
    )
    columns = [
        (None,) * replicas
        if v is None
        else strategy.experimental_local_results(v)
        for v in flat
    ]
    return tuple(
        tf.nest.pack_sequence_as(per_replica, [col[i] for col in columns])
        for i in range(replicas)
    )


def _after(_, value):
    """Returns `value`; the first argument only orders the call before it."""
    return (value,)
