"""A Keras `Distribution` runs on a replicator: one per distribution object.

`keras.distribution.set_distribution(d)` (and `d.scope()`) makes the
replicator of `d` the current `tf.distribute` strategy
(`tf.distribute.experimental_set_strategy`), so Keras builds models,
variables and optimizers under it and `fit`/`evaluate`/`predict` run on
its replicas, exactly as under `with replicator.scope():`.

- `DataParallel` over a mesh of N devices is `LocalReplicator(devices=...)`
  over those devices: the same numbers and features.
- `ModelParallel` is the same replicator (every device computes 1/N of the
  batch) plus block storage for the variables its layout map splits
  (`sharded.py`).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
from keras.src.distribution import distribution_lib

from keras_replicator._src.core import placements
from keras_replicator._src.distribution import sharded
from keras_replicator._src.replicators import local

# Distribution -> its replicator. Weak: a distribution dropped by the user
# lets its replicator go.
_REPLICATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _local_devices() -> list[str]:
    return distribution_lib.list_devices()


def check_mesh(mesh) -> list[str]:
    """The mesh's devices as TensorFlow device names, checked.

    Raises:
        ValueError: If the mesh names more devices than exist here, or a
            device that does not exist.
    """
    names = [str(d) for d in np.asarray(mesh.devices).reshape(-1)]
    available = _local_devices()
    known = {sharded.short_device_name(d) for d in available}
    if len(names) > len(available):
        raise ValueError(
            f"The device mesh has {len(names)} devices but only "
            f"{len(available)} exist here ({available}). Received: mesh "
            f"shape={tuple(mesh.shape)}, axes={tuple(mesh.axis_names)}"
        )
    missing = [d for d in names if sharded.short_device_name(d) not in known]
    if missing:
        raise ValueError(
            f"The device mesh names devices that do not exist here: "
            f"{missing}; the devices are {available}. Received: mesh "
            f"shape={tuple(mesh.shape)}, devices={names}"
        )
    if len(set(map(sharded.short_device_name, names))) != len(names):
        raise ValueError(
            "The device mesh names a device twice. Received: mesh "
            f"devices={names}"
        )
    return ["/" + sharded.short_device_name(d) for d in names]


def replicator_for(distribution: Any):
    """The replicator that runs `distribution` (made once per object).

    Raises:
        NotImplementedError: For a `Distribution` other than `DataParallel`
            and `ModelParallel`.
        ValueError: If its mesh does not fit this host's devices.
    """
    if distribution in _REPLICATORS:
        return _REPLICATORS[distribution]
    if not isinstance(
        distribution,
        (distribution_lib.DataParallel, distribution_lib.ModelParallel),
    ):
        raise NotImplementedError(
            "keras-replicator runs `keras.distribution.DataParallel` and "
            "`ModelParallel` on TensorFlow; other distributions are not "
            f"supported. Received: distribution={distribution!r}"
        )
    devices = check_mesh(distribution.device_mesh)
    replicator = local.LocalReplicator(devices=devices)
    setattr(replicator, placements.DISTRIBUTION_ATTR, distribution)
    _REPLICATORS[distribution] = replicator
    return replicator
