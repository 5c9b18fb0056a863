"""Callbacks for replicated training: batch norm, metrics, warm-up, timeline."""

from keras_replicator._src.callbacks.metric_reduction import MetricReduction
from keras_replicator._src.callbacks.sync_batch_norm import SyncBatchNorm
from keras_replicator._src.callbacks.timeline import Timeline
from keras_replicator._src.callbacks.warmup import LinearWarmup

__all__ = (
    "LinearWarmup",
    "MetricReduction",
    "SyncBatchNorm",
    "Timeline",
)
