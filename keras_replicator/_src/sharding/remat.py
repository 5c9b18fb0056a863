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
rows; Adam's numbers differ). A tied embedding (keras-hub's
`ReversibleEmbedding` with `tie_weights=True`) also multiplies by the
table, and its gradient is dense on one device too: it is rematerialised.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.common import remat as keras_remat

from keras_replicator._src.core import placements

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
        layer._remat_mode = keras_remat.RematScope(mode="full")
        layer.rematerialized_call = _rematerialized_call
        setattr(layer, _ATTR, True)


def _sparse_lookup(layer) -> bool:
    return isinstance(layer, keras.layers.Embedding) and not getattr(
        layer, "tie_weights", False
    )


def _rematerialized_call(layer_call, *args, **kwargs):
    def call(*args, **kwargs):
        if not args or not all(tf.is_tensor(x) for x in args):
            # tf.recompute_grad takes tensors only.
            return layer_call(*args, **kwargs)
        return tf.recompute_grad(lambda *xs: layer_call(*xs, **kwargs))(*args)

    return call
