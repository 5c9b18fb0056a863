"""Callbacks for replicated training: sync batch norm, metrics, warm-up."""

from keras_replicator._src.callbacks.sync_batch_norm import SyncBatchNorm

__all__ = ("SyncBatchNorm",)
