"""Rematerialisation: a gathered weight lives for one layer at a time.

In a traced step a matmul's gradient reads the full weight (`_MatMulGrad`), so
a weight gathered in the forward pass would live until its backward use, and
every replica would peak at the whole model's weights. A layer owning sharded
variables therefore reruns its forward pass, gathering again, in the backward
pass (`tf.recompute_grad`): one more forward pass and all-gather per layer
(`benchmarks/memory.py`). Keras' `RematScope(mode="full")` alone fails on
TensorFlow: it passes keyword arguments (`training=`) to `tf.recompute_grad`,
which refuses them in a graph ("supports keywords arguments only when eager
execution is enabled"); here they are bound first. A layer the user gave a
remat mode keeps it. Not rematerialised: an embedding lookup (its gradient
needs only the ids, and `tf.recompute_grad` would make its sparse gradient
dense: Adam's numbers differ), nor a tied `ReversibleEmbedding` or a stock
`Dense`/`EinsumDense` whose kernel only `sharding/contraction`'s op reads (it
keeps no full weight for the backward pass).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_replicator._src.core import placements
from keras_replicator._src.sharding import contraction
from keras_replicator._src.upstream import keras_remat

# Marks a layer set up here (instance attribute).
_ATTR = "_keras_replicator_remat"


def rematerialize(model: Any) -> None:
    """Rematerialises every layer of `model` that owns sharded variables."""
    for layer in model._flatten_layers(include_self=False):
        if getattr(layer, _ATTR, False) or layer._remat_mode is not None:
            continue
        own = list(layer._trainable_variables) + list(
            layer._non_trainable_variables
        )
        if not placements.any_sharded(own) or _sparse_lookup(layer):
            continue
        if _contracted(layer, own):
            continue
        layer._remat_mode = keras_remat.RematScope(mode="full")
        layer.rematerialized_call = _rematerialized_call
        setattr(layer, _ATTR, True)


def _contracted(layer, own) -> bool:
    """Whether a stock `Dense`/`EinsumDense` reads its kernel only to contract.

    `sharding/contraction` makes that `ops.matmul`/`ops.einsum` one op that
    gathers the kernel again in its backward pass (or never).
    """
    kind = type(layer)
    if kind.call not in (
        keras.layers.Dense.call,
        keras.layers.EinsumDense.call,
    ):
        return False
    if getattr(layer, "lora_enabled", False) or getattr(
        layer, "quantization_mode", None
    ):
        return False
    kernel = getattr(layer, "_kernel", None)
    if [v for v in own if placements.of(v) is not None] != [kernel]:
        return False
    if kind.call is keras.layers.EinsumDense.call:
        return contraction.parse(layer.equation, len(kernel.shape)) is not None
    return True


def _sparse_lookup(layer) -> bool:
    if not isinstance(layer, keras.layers.Embedding):
        return False
    if not getattr(layer, "tie_weights", False):
        return True
    # A tied `ReversibleEmbedding` (Keras', which keras-hub's Gemma builds,
    # or keras-hub's own) computes `ops.matmul(x, ops.transpose(table))`,
    # one `sharding/contraction` op, unless it casts first (`reverse_dtype`).
    return (
        type(layer).__name__ == "ReversibleEmbedding"
        and type(layer).__module__.startswith(("keras_hub.", "keras.src."))
        and getattr(layer, "reverse_dtype", "unknown") is None
    )


def _rematerialized_call(layer_call, *args, **kwargs):
    def call(*args, **kwargs):
        if not args or not all(tf.is_tensor(x) for x in args):
            # tf.recompute_grad takes tensors only.
            return layer_call(*args, **kwargs)
        return tf.recompute_grad(lambda *xs: layer_call(*xs, **kwargs))(*args)

    return call
