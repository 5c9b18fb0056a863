"""Replicator backends and cross-replica tools for Keras 3 on TensorFlow.

Make ordinary Keras code run replicated with one change:

    replicator = keras_replicator.auto()
    with replicator.scope():
        model = ...  # build and compile as usual
    model.fit(...)
"""

from keras_replicator import data
from keras_replicator._src.devices import configure_cpu_replicas
from keras_replicator._src.replicators.auto import auto
from keras_replicator._src.replicators.local import LocalReplicator
from keras_replicator._src.replicators.multi_worker import MultiWorkerReplicator
from keras_replicator._src.replicators.tpu import TpuReplicator

__version__ = "0.1.0.dev0"

__all__ = (
    "LocalReplicator",
    "MultiWorkerReplicator",
    "TpuReplicator",
    "auto",
    "configure_cpu_replicas",
    "data",
)
