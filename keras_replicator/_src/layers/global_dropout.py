"""Dropout masks drawn for the global batch, as one device draws them.

Keras' `Dropout` draws its mask from the layer's seed generator with a
stateless op. Under `tf.distribute` every replica holds the same seed, so
every replica draws the same mask for its own slice: the global batch's
mask is one slice's mask repeated, neither one device's numbers nor
independent draws (stock `MirroredStrategy` does exactly this). On JAX,
`keras.distribution` runs one program over the whole mesh and draws the
global batch's mask once, which is one device's mask.

`global_masks(model)` gives a model's `Dropout` layers that meaning for the
length of a `fit` under `keras.distribution`: each replica draws the mask
of the whole global batch from the same seed (the seed generator advances
once, as on one device) and keeps the rows of its slice. The cost is the
random numbers of the global batch on every replica, a transient N times
the slice's mask; nothing is communicated. Exact when the global batch
splits evenly over the replicas (every full batch); a last batch that
splits unevenly gets valid, independent masks, not one device's.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from keras_replicator._src.layers import in_place


def _global_call(layer, inputs, training=False):
    """`Dropout.call`, with the mask of the global batch's rows."""
    if not training or layer.rate <= 0:
        return inputs
    ctx = tf.distribute.get_replica_context()
    noise = layer.noise_shape
    if (
        ctx is None
        or ctx.num_replicas_in_sync == 1
        or (noise is not None and noise[0] == 1)
    ):
        # One replica, or a mask the same for every example: as drawn.
        return type(layer).call(layer, inputs, training=training)
    shape = tf.shape(inputs)
    rows = shape[0]
    dims = [
        shape[i] if noise is None or noise[i] is None else noise[i]
        for i in range(1, len(inputs.shape))
    ]
    global_shape = tf.stack([rows * ctx.num_replicas_in_sync, *dims])
    # One device's draw: the same op and seed over the global batch.
    mask = keras.random.dropout(
        tf.ones(global_shape, inputs.dtype),
        layer.rate,
        seed=layer.seed_generator,
    )
    start = tf.cast(ctx.replica_id_in_sync_group, tf.int32) * rows
    return inputs * mask[start : start + rows]


@contextlib.contextmanager
def global_masks(model):
    """While open, every `Dropout` of `model` draws the global batch's mask.

    The train function is traced anew on entry and on exit, so `fit` inside
    the block draws one device's masks and a later `fit` outside it draws
    as stock Keras does. Subclasses of `Dropout` with a `call` of their own
    are left as they are.

    Args:
        model: A Keras model.

    Yields:
        The layers it changed.
    """
    layers = [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if isinstance(layer, keras.layers.Dropout)
        and type(layer).call is keras.layers.Dropout.call
        and "call" not in vars(layer)
    ]
    with in_place.overridden(model, layers, "call", _global_call):
        yield layers
