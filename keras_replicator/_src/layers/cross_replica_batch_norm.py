"""Batch normalization over the global batch of all replicas and workers.

TF-Replicator's paper credits global BN for scaling BigGAN (small per-replica
batches give noisy statistics). Keras 3's `synchronized=True` (TensorFlow
only) issues three all-reduces per layer (sum, sum of squares, count) and
computes E[x^2] - E[x]^2; this issues ONE per layer and step, of the packed
[sum, sum of squares, count], around a shift.

E[x^2] - E[x]^2 cancels catastrophically when the mean is large against the
spread (float32, mean 1e4, std 1: a variance error of several units). With
S1 = sum(x - K), S2 = sum((x - K)^2), var = S2/n - (S1/n)^2 loses only about
(mean - K)^2 / var times the float32 epsilon. K is the moving mean (mirrored:
identical everywhere, no communication), 0 at first, then near the data
mean. float16/bfloat16 are reduced in float32 (Keras casts already; we cast
again for direct callers). Each replica sends its own example count, so a
last batch split 3/1/0/0 gives those four examples' moments.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_replicator._src import collectives
from keras_replicator._src import gradients
from keras_replicator._src.layers import in_place

_LOW_PRECISION = (tf.float16, tf.bfloat16)


def cross_replica_moments(x, reduction_axes, axis, mask=None, shift=None):
    """Mean and variance of `x` over the global batch, with one all-reduce.

    In a replica context with more than one replica in sync, over every
    replica of every worker (so all replicas must call it at the same point
    of the step); elsewhere local, by the same formula. `reduction_axes` are
    all but the feature `axis` (an int, negative from the end). `mask`
    (shape `x.shape[:-1]`, True where a position counts) is as Keras' BN
    takes it. `shift` (`[channels]`, equal on all replicas, no gradient;
    default zeros) is subtracted before summing. Returns `(mean, variance)`
    of shape `[channels]`, float32 for float16/bfloat16 inputs, else
    `x.dtype`; the biased variance, clamped at 0.
    """
    x = tf.convert_to_tensor(x)
    if x.dtype in _LOW_PRECISION:
        x = tf.cast(x, tf.float32)
    rank = x.shape.rank
    axis = axis % rank
    channels = x.shape[axis]
    # Shape that broadcasts a per-channel vector against x.
    bshape = [1] * rank
    bshape[axis] = channels
    if shift is None:
        shift = tf.zeros([channels], x.dtype)
    shift = tf.stop_gradient(tf.cast(shift, x.dtype))
    centered = x - tf.reshape(shift, bshape)

    if mask is None:
        s1 = tf.reduce_sum(centered, axis=reduction_axes)
        s2 = tf.reduce_sum(tf.square(centered), axis=reduction_axes)
        # One count for all channels: the elements per channel here.
        count = tf.cast(tf.size(x, out_type=tf.int64) // channels, x.dtype)
        count = count[tf.newaxis]
    else:
        weights = tf.cast(mask, x.dtype)[..., tf.newaxis]
        weights = tf.broadcast_to(weights, tf.shape(x))
        s1 = tf.reduce_sum(centered * weights, axis=reduction_axes)
        s2 = tf.reduce_sum(tf.square(centered) * weights, axis=reduction_axes)
        count = tf.reduce_sum(weights, axis=reduction_axes)

    packed = tf.concat([s1, s2, count], axis=0)
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        # The one collective of this layer and step.
        (packed,) = collectives.all_reduce(ctx, "sum", [packed])
    s1, s2, count = tf.split(
        packed, [channels, channels, packed.shape[0] - 2 * channels]
    )
    mean_centered = tf.math.divide_no_nan(s1, count)
    variance = tf.math.divide_no_nan(s2, count) - tf.square(mean_centered)
    # Rounding can leave a tiny negative variance: bad as a moving variance.
    variance = tf.maximum(variance, 0.0)
    return shift + mean_centered, variance


@keras.saving.register_keras_serializable(package="keras_replicator")
class CrossReplicaBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with statistics over the global batch.

    Training-mode statistics cover every replica of every worker, in one
    all-reduce per layer and step of [sum, sum of squares, count]: exact
    when replicas hold different numbers of examples, and identical moving
    statistics everywhere. Sums are taken around the moving mean (see the
    module docstring); low-precision inputs are reduced in float32.

    Outside a replicator, in cross-replica context, with one replica or at
    inference it is exactly `keras.layers.BatchNormalization`. Works with
    any `steps_per_execution`. For an existing model's BN layers, use
    `keras_replicator.callbacks.SyncBatchNorm` instead.

    Example:
    ```python
    replicator = kr.LocalReplicator(num_replicas=2)
    with replicator.scope():
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(8),
            kr.layers.CrossReplicaBatchNormalization(),
            keras.layers.Dense(1),
        ])
        model.compile("sgd", "mse")
    model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
    ```

    Args:
        **kwargs: `keras.layers.BatchNormalization`'s arguments (`axis=-1`,
            `momentum=0.99`, `epsilon=1e-3`, `center`, `scale`,
            initializers, regularizers, constraints, `renorm...`), except
            `synchronized`: this layer always synchronizes.

    Raises:
        ValueError: If `synchronized=True` is passed.
    """

    def __init__(self, **kwargs):
        if kwargs.pop("synchronized", False):
            raise ValueError(
                "CrossReplicaBatchNormalization always synchronizes with "
                "its own single all-reduce; leave `synchronized` unset. "
                "Received: synchronized=True"
            )
        super().__init__(synchronized=False, **kwargs)

    def _moments(self, inputs, mask):
        return sync_moments(self, inputs, mask)


def sync_moments(layer, inputs, mask):
    """Keras `BatchNormalization._moments`, over the global batch.

    Keras' `call` uses `self._moments(inputs, mask)` in training mode for
    `(mean, variance)` of shape `[channels]`; `layer` is built, `inputs`
    float32 or wider, and the result is in `inputs.dtype`.
    """
    mean, variance = cross_replica_moments(
        inputs,
        layer._reduction_axes,
        layer.axis,
        mask=mask,
        shift=layer.moving_mean,
    )
    return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)


def global_statistics_due(layer) -> bool:
    """Whether `layer` normalizes by the global batch, traced now.

    Asked by `patches/batch_statistics.py` of every training-mode Keras BN:

    - under a `keras.distribution`'s replicator: yes, as JAX's one program
      over the mesh;
    - under a replicator with `sync_batch_norm=True` (default), in a step
      of one device's convention (Keras step, `replicate`): yes;
    - in the user's own `strategy.run`, with `sync_batch_norm=False`, other
      strategies, one replica, no strategy: no (stock per-replica stats);
    - `synchronized=True` layers keep Keras' own synchronized moments.

    As with gradients (`gradients.one_device_convention`), one-device code
    gets one device's statistics, tf.distribute code keeps tf.distribute's.
    """
    if getattr(layer, "synchronized", False):
        return False
    if in_place.under_distribution():
        return True
    strategy = tf.distribute.get_strategy()
    if not gradients.is_ours(strategy) or not getattr(
        strategy, "sync_batch_norm", False
    ):
        return False
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return False
    return gradients.one_device_convention(strategy=strategy)
