"""Batch normalization over the global batch of all replicas and workers.

TF-Replicator's paper credits global batch norm for scaling BigGAN: with
small per-replica batches, per-replica statistics are too noisy. Keras 3's
`BatchNormalization(synchronized=True)` (TensorFlow only) issues three
all-reduces per layer (sum, sum of squares, count) and computes the
variance as E[x^2] - E[x]^2. This module issues ONE all-reduce per layer
and step, of the packed vector [sum, sum of squares, count], and shifts the
data first so the variance keeps its precision.

Numerics. E[x^2] - E[x]^2 cancels catastrophically when the mean is large
against the spread: float32 data with mean 1e4 and standard deviation 1
gives a variance error of several units. Computing the two sums around a
shift K, S1 = sum(x - K) and S2 = sum((x - K)^2), and then
var = S2/n - (S1/n)^2, loses only about (mean - K)^2 / var times the
float32 epsilon. The best K needs no communication and is identical on
every replica: the layer's moving mean (a mirrored variable). At
initialisation it is 0, which is the plain formula; as training goes on it
approaches the data mean. Inputs of low precision (float16, bfloat16) are
moments in float32 (Keras' layer already casts them; we cast again for
direct callers). The variance is clamped at 0.

Exactness with unequal batches: each replica contributes its own example
count, so a last batch split 3/1/0/0 over four replicas gives the moments
of those four examples, not an average of per-replica moments.
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

    In a replica context with more than one replica in sync (inside
    `strategy.run`, or a Keras `train_step` under a replicator), the
    statistics cover every replica of every worker. Anywhere else (no
    strategy, cross-replica context, one replica) they are local, with the
    same formula. Every replica must call it at the same point of the step,
    as with any collective.

    Args:
        x: The input tensor.
        reduction_axes: The axes to reduce, all but `axis`.
        axis: The feature axis (an int; negative counts from the end).
        mask: Optional mask of shape `x.shape[:-1]`, True where an example
            (position) counts, as Keras' `BatchNormalization` takes it.
        shift: Optional tensor of shape `[x.shape[axis]]`, the same on every
            replica, subtracted before summing for precision (no gradient
            flows through it). Defaults to zeros.

    Returns:
        `(mean, variance)`, each of shape `[x.shape[axis]]`, in float32 for
        float16/bfloat16 inputs and in `x.dtype` otherwise. The variance is
        the biased (population) variance, clamped at 0.
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
    # Rounding can leave a tiny negative variance; sqrt(var + eps) of it
    # would still be defined, but a negative moving variance is not.
    variance = tf.maximum(variance, 0.0)
    return shift + mean_centered, variance


@keras.saving.register_keras_serializable(package="keras_replicator")
class CrossReplicaBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with statistics over the global batch.

    A `keras.layers.BatchNormalization` whose training-mode statistics
    cover the whole global batch: every replica of every worker in sync.
    Each layer issues one all-reduce per step, of [sum, sum of squares,
    count], so the statistics are exact when replicas hold different
    numbers of examples, and every replica computes the same mean and
    variance and so keeps the same moving statistics. Sums are taken around
    the moving mean for precision (see the module docstring); low-precision
    inputs are reduced in float32.

    Outside a replicator, in a cross-replica context, with one replica, or
    at inference (`training=False`, `evaluate`, `predict`) it behaves
    exactly like `keras.layers.BatchNormalization`. It works under
    `model.fit` with any `steps_per_execution`.

    To turn the BN layers of an existing model into cross-replica ones
    without changing its code, use `keras_replicator.callbacks.SyncBatchNorm`
    instead.

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
        **kwargs: The arguments of `keras.layers.BatchNormalization`
            (`axis=-1`, `momentum=0.99`, `epsilon=1e-3`, `center`, `scale`,
            initializers, regularizers, constraints, `renorm...`), except
            `synchronized`: this layer always synchronizes, with its own
            single all-reduce.

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

    Keras' `BatchNormalization.call` calls `self._moments(inputs, mask)` in
    training mode and expects `(mean, variance)` of shape `[channels]`.

    Args:
        layer: A built `keras.layers.BatchNormalization`.
        inputs: The layer's (float32 or wider) inputs.
        mask: Its mask, or None.

    Returns:
        `(mean, variance)` in `inputs.dtype`.
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

    What `patches/batch_statistics.py` asks of every Keras
    `BatchNormalization` in training mode. Decided when the step is traced:

    - under a `keras.distribution`'s replicator: yes, as on JAX, where one
      program runs over the whole mesh;
    - under a replicator with `sync_batch_norm=True` (the default), in a
      step of one device's convention (a Keras step, `replicate`): yes,
      so that single-device code gets one device's numbers;
    - in the user's own `strategy.run`, under `sync_batch_norm=False`,
      under any other strategy, with one replica, and outside a strategy:
      no, Keras' own per-replica statistics (stock `MirroredStrategy`'s);
    - a layer made with `synchronized=True` keeps Keras' own synchronized
      moments.

    The rule is the gradient convention's (`gradients.one_device_convention`):
    code written for one device gets one device's statistics; code written
    for tf.distribute keeps tf.distribute's.
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
