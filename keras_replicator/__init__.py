"""Replicator backends and cross-replica tools for Keras 3 on TensorFlow.

Make ordinary Keras code run replicated with one change:

    replicator = keras_replicator.auto()
    with replicator.scope():
        model = ...  # build and compile as usual
    model.fit(...)
"""

from keras_replicator._src.cluster import lazy_package as _lazy_package

__version__ = "0.1.0.dev0"

if _lazy_package.defer():
    # Only in the `keras-replicator` command's process: its entry point
    # imports this package first, and `--help`, `launch` and `tf-config`
    # need no TensorFlow. The names below load on first use, or when a
    # command that needs TensorFlow calls `_lazy_package.load()`.
    def __getattr__(name: str):
        return _lazy_package.attribute(name)

else:
    from keras_replicator import callbacks
    from keras_replicator import data
    from keras_replicator import layers
    from keras_replicator._src.cluster.config import ClusterConfig
    from keras_replicator._src.cluster.notebook_launch import launch
    from keras_replicator._src.core import devices as _devices
    from keras_replicator._src.core.devices import configure_cpu_replicas
    from keras_replicator._src.distribution import api as _distribution_api
    from keras_replicator._src.distribution.api import shard_shapes
    from keras_replicator._src.distribution.process_info import is_chief
    from keras_replicator._src.distribution.process_info import process_count
    from keras_replicator._src.distribution.process_info import process_index
    from keras_replicator._src.primitives import all_gather
    from keras_replicator._src.primitives import all_max
    from keras_replicator._src.primitives import all_mean
    from keras_replicator._src.primitives import all_min
    from keras_replicator._src.primitives import all_reduce
    from keras_replicator._src.primitives import all_sum
    from keras_replicator._src.primitives import broadcast
    from keras_replicator._src.primitives import num_replicas
    from keras_replicator._src.primitives import replica_id
    from keras_replicator._src.replicators.async_errors import (
        ParameterServerError,
    )
    from keras_replicator._src.replicators.async_ps import AsyncReplicator
    from keras_replicator._src.replicators.auto import auto
    from keras_replicator._src.replicators.local import LocalReplicator
    from keras_replicator._src.replicators.multi_worker import (
        MultiWorkerReplicator,
    )
    from keras_replicator._src.replicators.tpu import TpuReplicator
    from keras_replicator._src.sharding.auto_layout import auto_layout_map
    from keras_replicator._src.sharding.checkpoint import (
        load as load_checkpoint,
    )
    from keras_replicator._src.sharding.checkpoint import (
        save as save_checkpoint,
    )
    from keras_replicator._src.sharding.report import layout_report
    from keras_replicator._src.training.optimizer import ReplicatedOptimizer

    # Imported before TensorFlow's first op, split the CPU into logical
    # devices now, so CPU replicas can be created later, after other
    # TensorFlow code (`KERAS_REPLICATOR_SPLIT_CPU=0` turns it off; see
    # `_devices.split_cpu_at_import`).
    _devices.split_cpu_at_import()
    # `keras.distribution` (DataParallel, ModelParallel) runs on replicators.
    _distribution_api.enable()

__all__ = (
    "AsyncReplicator",
    "ClusterConfig",
    "LocalReplicator",
    "MultiWorkerReplicator",
    "ParameterServerError",
    "ReplicatedOptimizer",
    "TpuReplicator",
    "all_gather",
    "all_max",
    "all_mean",
    "all_min",
    "all_reduce",
    "all_sum",
    "auto",
    "auto_layout_map",
    "broadcast",
    "callbacks",
    "configure_cpu_replicas",
    "data",
    "is_chief",
    "launch",
    "layers",
    "layout_report",
    "load_checkpoint",
    "num_replicas",
    "process_count",
    "process_index",
    "replica_id",
    "save_checkpoint",
    "shard_shapes",
)
