"""What is known about the running replica step: a leaf module.

Two facts decide how an optimizer combines the replicas' gradients
(`patches/replica_mean.py`), and both are only known while a replica's
function is traced:

- **Which API runs the step.** Keras' `fit`/`evaluate` (a model's
  `train_step`/`test_step`, built-in or custom) and the TF-Replicator API
  (`replicate`) are written as for one device: a loss is the mean over the
  replica's own examples, and the replicas' gradients are averaged.
  `tf.distribute`'s own `strategy.run` keeps tf.distribute's convention:
  each replica's loss is its share of the global loss, and the shares'
  gradients are summed. `recording` notes the API; `api_of` tells it from
  the function given to `run`.
- **How many examples the replica got.** One device averages a loss over
  the examples of its batch. A global batch that does not split evenly (the
  ragged last batch of NumPy input: 57 examples on 2 replicas are 29 and
  28) gives replicas shares of different sizes, and one device's gradient
  is then the mean of the replicas' gradients weighted by their example
  counts. `recording` notes the leading dimension of the first batched
  input.

It also collects one fact the step's own code reveals: whether a loss was
scaled as a share (`tf.nn.compute_average_loss`, `scale_regularization_loss`
or Keras' stock loss scaling), `ReplicaStep.shares`.

In-graph replicators wrap every function given to `strategy.run` with
`recording`, which keeps the record on the replica's own thread
(MirroredStrategy traces each replica on its own thread) while the function
runs; `current()` reads it. A `tf.function` given to `run` is not wrapped
(MirroredStrategy runs the replicas inside it) and has no record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from keras_replicator._src.upstream import ag_ctx
from keras_replicator._src.upstream import autograph

# The APIs a replica step can come from.
KERAS = "keras"  # a Keras model's train_step / test_step / predict_step
REPLICATOR = "replicator"  # `replicator.replicate`
TF_DISTRIBUTE = "tf.distribute"  # the user's own `strategy.run`
_KERAS_STEPS = ("train_step", "test_step", "predict_step")
# A replicator's `gradient_reduction`: "auto" follows the API, the others
# override it for every update (`patches/replica_mean.py`).
GRADIENT_REDUCTIONS = ("auto", "mean", "sum")
# Set on a function by `mark` to name its API explicitly.
_API_ATTR = "_keras_replicator_api"

_local = threading.local()


@dataclasses.dataclass
class ReplicaStep:
    """One replica's step while it is traced.

    Attributes:
        api: `KERAS`, `REPLICATOR` or `TF_DISTRIBUTE`.
        count: The replica's example count: a float32 scalar tensor when
            the batch size is only known at run time, an `int` when it is
            static (the same on every replica, since replicas share their
            batches' spec), or None when the step's arguments hold no
            batch.
        shares: True once the step scaled a loss as its share of the
            global loss.
    """

    api: str
    count: tf.Tensor | int | None
    shares: bool = False


@contextlib.contextmanager
def compiled_step():
    """Marks the replica step traced inside as compiled by XLA on its own.

    `patches/per_replica_jit.py` traces each replica's step in it: such a
    step cannot all-reduce inside (see `in_compiled_step`).
    """
    _local.compiled = getattr(_local, "compiled", 0) + 1
    try:
        yield
    finally:
        _local.compiled -= 1


def in_compiled_step() -> bool:
    """Whether this thread traces a replica step that XLA compiles alone."""
    return getattr(_local, "compiled", 0) > 0


@tf.autograph.experimental.do_not_convert
def current() -> ReplicaStep | None:
    """The replica step running on this thread, or None outside of one."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def mark(fn: Callable[..., Any], api: str) -> Callable[..., Any]:
    """Names the API `fn` belongs to, for `api_of`; returns `fn`."""
    setattr(fn, _API_ATTR, api)
    return fn


def keras_step(step_function: Callable[..., Any]) -> Callable[..., Any]:
    """`step_function` (a model's train/test step) marked as `KERAS`.

    A plain function that calls it, so that a step Keras starts is known as
    one however the user wrote it (decorated, a `tf.function`, assigned on
    the instance).
    """

    def step(data):
        return step_function(data)

    return mark(step, KERAS)


def api_of(fn: Callable[..., Any]) -> str:
    """The API a function given to `strategy.run` comes from.

    A function marked by `mark` names its own (Keras' trainer marks its
    steps, see `keras_step`); a Keras model's `train_step`, `test_step` or
    `predict_step` given to `run` directly (bound, possibly wrapped with
    `functools.wraps`) is `KERAS`; anything else is the user's own
    `strategy.run`: `TF_DISTRIBUTE`.
    """
    marked = getattr(fn, _API_ATTR, None)
    if marked is not None:
        return marked
    while fn is not None:
        owner = getattr(fn, "__self__", None)
        if getattr(fn, "__name__", None) in _KERAS_STEPS and _is_keras_model(
            owner
        ):
            return KERAS
        fn = getattr(fn, "__wrapped__", None)
    return TF_DISTRIBUTE


def _is_keras_model(owner) -> bool:
    # Imported here: keras is loaded long before any step runs.
    import keras

    return isinstance(owner, keras.Model)


@tf.autograph.experimental.do_not_convert
def recording(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps `fn` (for `strategy.run`) to keep its `ReplicaStep` current.

    `fn` is converted by AutoGraph exactly as `strategy.run` would have
    converted it; the wrapper itself is not converted. A `tf.function` is
    returned as it is: `MirroredStrategy` runs the replicas inside it (it
    must stay a `tf.function` for that), and it has no record, so its
    updates follow tf.distribute's convention.

    Args:
        fn: The replica function.

    Returns:
        A function with `fn`'s signature and results.
    """
    if isinstance(fn, tf.types.experimental.PolymorphicFunction):
        return fn
    api = api_of(fn)
    converted = autograph.tf_convert(
        fn, ag_ctx.control_status_ctx(), convert_by_default=False
    )

    @tf.autograph.experimental.do_not_convert
    @functools.wraps(fn)
    def replica_fn(*args, **kwargs):
        stack = _local.__dict__.setdefault("stack", [])
        stack.append(ReplicaStep(api, _count_of((args, kwargs))))
        try:
            return converted(*args, **kwargs)
        finally:
            stack.pop()

    return replica_fn


def _count_of(structure) -> tf.Tensor | int | None:
    """The leading dimension of the first batched tensor in `structure`."""
    for leaf in tf.nest.flatten(structure):
        if isinstance(leaf, tf.RaggedTensor):
            return tf.cast(leaf.nrows(), tf.float32)
        if isinstance(leaf, tf.SparseTensor):
            return tf.cast(leaf.dense_shape[0], tf.float32)
        if isinstance(leaf, tf.Tensor) and leaf.shape.rank:
            if leaf.shape[0] is not None:
                # Static: every replica has this batch spec, so this count.
                return int(leaf.shape[0])
            return tf.cast(tf.shape(leaf)[0], tf.float32)
    return None
