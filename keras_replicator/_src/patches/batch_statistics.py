"""`BatchNormalization`'s training statistics: the global batch's where due.

A `BatchNormalization` in training normalizes by its batch's moments; under
tf.distribute each replica sees its share, so statistics, loss, gradients
and moving statistics are not one device's (keras.io's convnet on 2
processes: epoch-3 loss 1.3166 against 1.3005).

This patch owns `BatchNormalization._moments`. Where the traced step is one
device's code under a replicator with `sync_batch_norm=True` (the default:
`fit`, `evaluate`, `train_on_batch`, a custom `train_step`, `replicate`), or
under a `keras.distribution`, the moments are the global batch's, one
all-reduce per layer and step (`cross_replica_batch_norm.sync_moments`, as
`kr.callbacks.SyncBatchNorm`). Elsewhere (`strategy.run`,
`sync_batch_norm=False`, a stock or no strategy, `synchronized=True`) they
are Keras'. The rule is `cross_replica_batch_norm.global_statistics_due`.

A class attribute decided when traced: layers stay plain Keras (a saved
model is plain Keras); `SyncBatchNorm` shadows it per instance during its
`fit`. With `jit_compile=True` on several replicas each replica's compiled
step cannot all-reduce: statistics stay per replica, with one warning
(`patches/per_replica_jit.py`).
"""

from __future__ import annotations

import warnings

import keras

from keras_replicator._src.core import replica_step
from keras_replicator._src.layers import cross_replica_batch_norm as crbn
from keras_replicator._src.patches import registry

_COMPILED_NOTE = (
    "keras-replicator: with `jit_compile=True` on several replicas, each "
    "replica's step is compiled by XLA on its own device and cannot "
    "all-reduce inside it, so `BatchNormalization` keeps each replica's "
    "own batch statistics there (not one device's). Compile with "
    "`jit_compile=False` for the global batch's statistics, or pass "
    "`sync_batch_norm=False` to the replicator to say you want per-replica "
    "ones."
)
_warned = []


def _moments(original, self, inputs, mask):
    if crbn.global_statistics_due(self):
        if not replica_step.in_compiled_step():
            return crbn.sync_moments(self, inputs, mask)
        if not _warned:
            _warned.append(True)
            warnings.warn(_COMPILED_NOTE, stacklevel=2)
    return original(self, inputs, mask)


PATCH = registry.register(
    registry.Patch(
        name="batch_statistics",
        targets=(
            registry.Target(
                keras.layers.BatchNormalization, "_moments", _moments
            ),
        ),
        applies_to=frozenset({"local", "multi_worker"}),
        pins=(
            registry.Pin(
                "keras.src.layers.normalization.batch_normalization",
                (
                    "mean, variance = self._moments(inputs, mask)",
                    "def _moments(self, inputs, mask):",
                ),
            ),
        ),
        delete_when=(
            "never: tf.distribute's per-replica statistics are its "
            "convention; this is one device's, for one device's code"
        ),
    )
)
