"""How many examples the running replica step got: a leaf module.

One device averages a loss over the examples of its batch. Under several
replicas each replica averages over its own share, and a global batch that
does not split evenly (the ragged last batch of NumPy input: 57 examples on
2 replicas are 29 and 28) gives the replicas shares of different sizes. The
gradient one device computes is then the mean of the replicas' gradients
weighted by their example counts, not the plain mean.

In-graph replicators wrap every function given to `strategy.run` with
`recording`, which notes the leading dimension of the first batched input on
the replica's own thread (MirroredStrategy traces each replica on its own
thread) while the function runs. The optimizer patch (`patches/
replica_mean.py`) reads it with `current()` and weights the gradients it
all-reduces by it. A function whose arguments hold no batched tensor
(`strategy.run(fn)` with no arguments) records nothing, and the replicas
count equally.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.impl import api as autograph

_local = threading.local()


@tf.autograph.experimental.do_not_convert
def current() -> tf.Tensor | int | None:
    """The example count of the replica step running on this thread.

    Returns:
        A float32 scalar tensor when the batch size is only known at run
        time, an `int` when it is static (the same on every replica, since
        replicas share their batches' spec), or None when the step's
        arguments hold no batch.
    """
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@tf.autograph.experimental.do_not_convert
def recording(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps `fn` (for `strategy.run`) to record its batch's example count.

    `fn` is converted by AutoGraph exactly as `strategy.run` would have
    converted it; the wrapper itself is not converted. A `tf.function` is
    returned as it is: `MirroredStrategy` runs the replicas inside it (it
    must stay a `tf.function` for that), and its steps count equally.

    Args:
        fn: The replica function.

    Returns:
        A function with `fn`'s signature and results.
    """
    if isinstance(fn, tf.types.experimental.PolymorphicFunction):
        return fn
    converted = autograph.tf_convert(
        fn, ag_ctx.control_status_ctx(), convert_by_default=False
    )

    @tf.autograph.experimental.do_not_convert
    @functools.wraps(fn)
    def replica_fn(*args, **kwargs):
        stack = _local.__dict__.setdefault("stack", [])
        stack.append(_count_of((args, kwargs)))
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
