"""`keras.distribution` on TensorFlow, switched on by `import keras_replicator`.

See `runtime.py` (a distribution runs on a replicator), `sharded.py`
(variables stored in blocks) and `layout.py` (which block lives where); the
Keras hooks are the patches `keras_distribution` and `sharded_variables`.
"""

from __future__ import annotations

from keras_replicator._src.distribution import processes
from keras_replicator._src.distribution import runtime
from keras_replicator._src.distribution import sharded
from keras_replicator._src.patches import keras_distribution
from keras_replicator._src.patches import registry

shard_shapes = sharded.shard_shapes


def enable() -> None:
    """Fills Keras' TensorFlow distribution hooks (idempotent).

    The one patch not installed by a replicator: `keras.distribution` is
    used before any replicator exists.
    """
    keras_distribution.set_replicator_factory(runtime.replicator_for)
    processes.set_replicator_factory(runtime.process_replicator)
    keras_distribution.set_process_hooks(
        processes.initialize, processes.current
    )
    registry.install([keras_distribution.PATCH.name])
