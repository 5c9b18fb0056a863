"""A Keras `Distribution` runs on a replicator: one per distribution object.

`keras.distribution.set_distribution(d)` (and `d.scope()`) makes the
replicator of `d` the current `tf.distribute` strategy
(`tf.distribute.experimental_set_strategy`), so Keras builds models,
variables and optimizers under it and `fit`/`evaluate`/`predict` run on
its replicas, exactly as under `with replicator.scope():`.

- `DataParallel` over a mesh of N devices is `LocalReplicator(devices=...)`
  over those devices: the same numbers and features.
- After `keras.distribution.initialize()` joined several processes
  (`processes.py`), a mesh spans every process's devices and runs on a
  `MultiWorkerReplicator`; each process feeds its own part of the data,
  as Keras' `Distribution.distribute_dataset` cuts it.
- `ModelParallel` is the same replicator (every device computes 1/N of the
  batch) plus block storage for the variables its layout map splits
  (`sharding/sharded.py`).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import tensorflow as tf

from keras_replicator._src.cluster import process_layout
from keras_replicator._src.core import placements
from keras_replicator._src.distribution import processes
from keras_replicator._src.replicators import local
from keras_replicator._src.replicators import multi_worker
from keras_replicator._src.sharding import sharded
from keras_replicator._src.upstream import distribution_lib
from keras_replicator._src.upstream import (
    tf_data_distribute as _tf_data_distribute,
)

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
    if processes.current() is not None:
        return _check_process_order(mesh, names, available)
    return ["/" + sharded.short_device_name(d) for d in names]


def _check_process_order(mesh, names, available) -> list[str]:
    """A mesh over several processes: every device, in replica order.

    Block `r` of a sharded variable lives on replica `r` of the
    `MultiWorkerReplicator`, whose replicas are the processes' devices in
    process order: the mesh's flat order must be that order.

    Raises:
        NotImplementedError: For a mesh over some of the processes'
            devices, or in another order.
    """
    short = [sharded.short_device_name(d) for d in names]
    if short != [sharded.short_device_name(d) for d in available]:
        raise NotImplementedError(
            "Over several processes a device mesh must hold every device of "
            "every process, in `keras.distribution.list_devices()` order "
            "(process by process); a mesh over a subset or another order is "
            f"not supported. Received: mesh shape={tuple(mesh.shape)}, "
            f"devices={short}; the devices are {available}"
        )
    return list(available)


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
    joined = processes.current()
    if joined is None:
        replicator = local.LocalReplicator(devices=devices)
    else:
        replicator = ProcessReplicator(
            cluster=joined.cluster,
            replicas_per_worker=joined.replicas_per_worker,
        )
    setattr(replicator, placements.DISTRIBUTION_ATTR, distribution)
    _REPLICATORS[distribution] = replicator
    return replicator


class ProcessReplicator(multi_worker.MultiWorkerReplicator):
    """The `MultiWorkerReplicator` of a mesh over several processes.

    Keras feeds each process its own part of every global batch
    (`Distribution.distribute_dataset` cuts it by `process_id`, or the user
    does with `auto_shard_dataset=False`, as on JAX), so a dataset here is
    this process's batches: they are split over its replicas in order and
    never sharded again across workers. Process p's replicas then see
    the examples of global replicas p * k ... p * k + k - 1, as one device
    sees the global batch.
    """

    def experimental_distribute_dataset(self, dataset, options=None):
        """Splits this process's batches over its replicas, in order.

        As a replicator splits a batch of unknown size: each replica takes
        `ceil(batch / replicas)` rows until the batch runs out, so a batch
        that does not divide (a ragged last one) leaves the last replicas
        fewer rows, or none. The one process holding the last rows of such
        a batch splits them by its own count, which may differ from one
        host's split over every device (13 rows on 2 processes of 2
        devices are 4, 4 | 3, 2; on 4 devices of one host 4, 4, 4, 1);
        every replica is weighed by its rows, so the numbers are the same.
        """
        count = len(self.extended.worker_devices)
        # The replicators' own split (`experimental_distribute_dataset` of
        # a `MirroredStrategy` uses it for a batch of unknown size).
        per_replica = _tf_data_distribute._LegacyRebatchDataset(  # noqa: SLF001
            dataset, count
        )
        batches = int(dataset.cardinality())
        if batches >= 0:
            # Keeps the count `fit` reads its steps from (see
            # `patches/keras_distribution.py`).
            per_replica = per_replica.apply(
                tf.data.experimental.assert_cardinality(batches * count)
            )
        return self.distribute_datasets_from_function(
            lambda ctx: per_replica, options
        )


def process_replicator(cluster):
    """The `MultiWorkerReplicator` that joins this process to `cluster`."""
    # Several processes can be the point here (one device per process of a
    # ModelParallel mesh): no one-process advice.
    with process_layout.for_keras_distribution():
        return multi_worker.MultiWorkerReplicator(cluster=cluster)
