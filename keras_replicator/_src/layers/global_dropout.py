"""Dropout masks drawn for the global batch, as one device draws them.

Keras' `Dropout` draws its mask from the layer's seed generator with a
stateless op. Under `tf.distribute` every replica holds the same seed, so
the global mask is one slice's mask repeated, neither one device's numbers
nor independent draws (as stock `MirroredStrategy`). On JAX,
`keras.distribution` draws the global batch's mask once: one device's mask.

`use_global_masks(model)` does that under `keras.distribution`: each replica
all-gathers the replicas' row counts (one scalar per layer and step), draws
the global batch's mask from the same seed (advancing once, as on one
device) and keeps its slice's rows: one device's mask for any split, a
partial last batch included. Cost: a transient global mask on every
replica, N times the slice's.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_replicator._src import collectives
from keras_replicator._src.layers import in_place


def _global_call(layer, inputs, training=False):
    """`Dropout.call`, with the global batch's mask under a distribution."""
    if not training or layer.rate <= 0:
        return inputs
    ctx = tf.distribute.get_replica_context()
    noise = layer.noise_shape
    rank = inputs.shape.rank
    if (
        ctx is None
        or ctx.num_replicas_in_sync == 1
        or not in_place.under_distribution()
        or rank is None
        # No batch axis in noise_shape, or one mask for every example: same
        # on every replica as on one device.
        or (noise is not None and (len(noise) != rank or noise[0] == 1))
    ):
        return type(layer).call(layer, inputs, training=training)
    shape = tf.shape(inputs)
    rows = shape[0]
    counts = collectives.all_gather_equal(
        ctx, tf.reshape(tf.cast(rows, tf.int32), [1])
    )
    replica = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
    start = tf.reduce_sum(counts[:replica])
    dims = [
        shape[i] if noise is None or noise[i] is None else noise[i]
        for i in range(1, rank)
    ]
    # One device's draw: the same op and seed over the global batch.
    mask = keras.random.dropout(
        tf.ones(tf.stack([tf.reduce_sum(counts), *dims]), inputs.dtype),
        layer.rate,
        seed=layer.seed_generator,
    )[start : start + rows]
    # As stock: dropped entries are 0 whatever the input (inf too).
    return tf.where(mask > 0, inputs * mask, tf.zeros_like(inputs))


def use_global_masks(model) -> bool:
    """Makes `model`'s `Dropout` layers draw global masks under a distribution.

    Elsewhere they draw as stock Keras. Subclasses with their own `call`
    (`SpatialDropout*`) are left alone. Returns whether a layer changed now
    (then the train function must be retraced).
    """
    layers = [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if isinstance(layer, keras.layers.Dropout)
        and type(layer).call is keras.layers.Dropout.call
    ]
    return in_place.install(layers, "call", _global_call)
