"""Gathered weights live for one layer at a time: rematerialisation.

In a traced step, the gradient of a matmul needs the full weight
(`_MatMulGrad` reads its inputs), so a weight gathered in the forward pass
would stay alive until its backward use, and every replica would hold the
whole model's weights at the peak, as unsharded. A layer that owns sharded
variables is therefore rematerialised: its forward pass runs again in the
backward pass (`tf.recompute_grad`), gathering its weights again, and only
the layer being differentiated holds its full weights. The cost is one more
forward pass and all-gather per such layer (measured in
`benchmarks/memory.py`).

Keras' own `RematScope(mode="full")` would do this, but on TensorFlow it
passes the call's keyword arguments (`training=`) to `tf.recompute_grad`,
which refuses them in a graph ("supports keywords arguments only when
eager execution is enabled"); here they are bound first. A layer the user
gave a remat mode keeps it.

An embedding lookup is not rematerialised: its gradient needs only the ids,
not the table, so there is nothing to free, and `tf.recompute_grad` would
turn its sparse gradient dense (one device's optimizer sees the sparse
rows; Adam's numbers differ). A tied embedding (Keras' or keras-hub's
`ReversibleEmbedding` with `tie_weights=True`) also multiplies by the
table: that product is `sharding/contraction`'s op, which keeps no full
table for the backward pass, so it is not rematerialised either (unless it
casts the table first, `reverse_dtype`). Nor are a stock `Dense` or
`EinsumDense` whose kernel only that op reads.
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
    """Whether the layer's only sharded read is its kernel's contraction.

    A stock `Dense` or `EinsumDense` (no LoRA, not quantized) reads its
    kernel only in `ops.matmul`/`ops.einsum`, which `sharding/contraction`
    makes one op that gathers the kernel again in its backward pass (or
    never): nothing to rematerialise.
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
    # A tied `ReversibleEmbedding` (`keras.layers.ReversibleEmbedding`,
    # which keras-hub's Gemma, Mistral and BERT build, or keras-hub's own)
    # multiplies by the table as `ops.matmul(x, ops.transpose(table))`,
    # which `sharding/contraction` makes one op (the table is never held
    # for the backward pass), unless it casts the table first
    # (`reverse_dtype`).
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
