"""`keras.distribution` on TensorFlow, switched on by `import keras_replicator`.

See `runtime.py` (a distribution runs on a replicator), `sharding/sharded.py`
(variables in blocks) and `sharding/layout.py` (which block lives where);
the Keras hooks are the patches `keras_distribution` and `sharded_variables`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from keras_replicator._src.core import placements
from keras_replicator._src.distribution import processes
from keras_replicator._src.distribution import runtime
from keras_replicator._src.patches import backup_guard
from keras_replicator._src.patches import keras_distribution
from keras_replicator._src.patches import registry
from keras_replicator._src.sharding import sharded


def enable() -> None:
    """Fills Keras' TensorFlow distribution hooks (idempotent).

    Installed here, not by a replicator: `keras.distribution` is used
    before one exists, and fits under none find backups (`backup_guard`).
    """
    keras_distribution.set_replicator_factory(runtime.replicator_for)
    processes.set_replicator_factory(runtime.process_replicator)
    keras_distribution.set_process_hooks(
        processes.initialize, processes.current
    )
    registry.install([keras_distribution.PATCH.name, backup_guard.PATCH.name])


def shard_shapes(variable: Any) -> dict[str, tuple[int, ...]]:
    """Where a variable lives: `{device name: the shape stored there}`.

    TensorFlow's counterpart of JAX's `variable.value.sharding`. A variable
    split by a `ModelParallel` layout map shows its block's shape on every
    mesh device; a replicated one (`DataParallel`, a plain replicator, no
    layout) its full shape on every device holding a copy. Device names are
    `keras.distribution.list_devices()`'s (`"cpu:0"`, `"gpu:1"`).

    Example:
    ```python
    mesh = keras.distribution.DeviceMesh((1, 4), ("batch", "model"))
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map))
    layer = keras.layers.Dense(8, name="d1")
    layer.build((None, 16))
    kr.shard_shapes(layer.kernel)  # {"cpu:0": (16, 2), ..., "cpu:3": (16, 2)}
    ```

    Args:
        variable: A `keras.Variable` (or a `tf.Variable`).

    Returns:
        A dict from device name to the local shape, in device order.

    Raises:
        TypeError: If `variable` is not a variable.
    """
    placement = placements.of(variable)
    if placement is not None:
        return {
            sharded.short_device_name(d): placement.local_shape
            for d in placement.devices
        }
    inner = getattr(variable, "_value", variable)
    if not isinstance(inner, tf.Variable):
        raise TypeError(
            "`shard_shapes` takes a `keras.Variable` or `tf.Variable`. "
            f"Received: variable={variable!r} of type {type(variable)}"
        )
    components = getattr(inner, "values", None) or (inner,)
    strategy = getattr(inner, "distribute_strategy", None)
    joined = processes.current()
    if joined is not None and strategy and sharded.multi_process(strategy):
        # A copy on every replica of every process; this one holds its own.
        shape = tuple(int(d) for d in inner.shape)
        return {d: shape for d in joined.devices()}
    return {
        sharded.short_device_name(c.device): tuple(int(d) for d in c.shape)
        for c in components
    }
