"""Layers for replicated training: cross-replica batch normalization."""

from keras_replicator._src.layers.cross_replica_batch_norm import (
    CrossReplicaBatchNormalization,
)

__all__ = ("CrossReplicaBatchNormalization",)
