"""A Keras `Distribution` runs on a replicator: one per distribution object.

`keras.distribution.set_distribution(d)` (and `d.scope()`) makes `d`'s
replicator the current strategy (`tf.distribute.experimental_set_strategy`),
so models, variables, optimizers and `fit`/`evaluate`/`predict` work as
under `with replicator.scope():`. `DataParallel` over N devices is
`LocalReplicator(devices=...)` over them. After
`keras.distribution.initialize()` joined processes (`processes.py`), a mesh
spans all their devices on a `MultiWorkerReplicator`, each process feeding
its part of the data as `Distribution.distribute_dataset` cuts it.
`ModelParallel` is the same replicator (each device computes 1/N of the
batch) plus block storage for variables its layout map splits
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

# Distribution -> replicator; weak, so dropping one frees the other.
_REPLICATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _local_devices() -> list[str]:
    return distribution_lib.list_devices()


def check_mesh(mesh) -> list[str]:
    """The mesh's devices as TensorFlow names (ValueError: missing, twice)."""
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

    Block `r` of a sharded variable lives on the `MultiWorkerReplicator`'s
    replica `r`, the processes' devices in process order, so the mesh's flat
    order must match (else NotImplementedError).
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

    NotImplementedError unless `DataParallel` or `ModelParallel`;
    ValueError if its mesh does not fit this host's devices.
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

    Keras feeds each process its part of every global batch
    (`Distribution.distribute_dataset` cuts it by `process_id`, or the user
    with `auto_shard_dataset=False`, as on JAX), so datasets here are split
    over this process's replicas in order, never resharded: process p's
    replicas see global replicas p * k ... p * k + k - 1's examples.
    """

    def experimental_distribute_dataset(self, dataset, options=None):
        """Splits this process's batches over its replicas, in order.

        Each replica takes `ceil(batch / replicas)` rows until the batch
        runs out, so a ragged batch leaves the last replicas fewer or none.
        Per-process splits may differ from one host's (13 rows on 2
        processes of 2 devices: 4, 4 | 3, 2; on 4 devices: 4, 4, 4, 1), but
        replicas are weighed by rows, so the numbers are the same.
        """
        count = len(self.extended.worker_devices)
        # `MirroredStrategy`'s split of a batch of unknown size.
        per_replica = _tf_data_distribute._LegacyRebatchDataset(  # noqa: SLF001
            dataset, count
        )
        batches = int(dataset.cardinality())
        if batches >= 0:
            # `fit` reads its steps from it (patches/keras_distribution.py).
            per_replica = per_replica.apply(
                tf.data.experimental.assert_cardinality(batches * count)
            )
        return self.distribute_datasets_from_function(
            lambda ctx: per_replica, options
        )


def process_replicator(cluster):
    """The `MultiWorkerReplicator` that joins this process to `cluster`."""
    # One device per process can be intended (ModelParallel): no one-process
    # advice.
    with process_layout.for_keras_distribution():
        return multi_worker.MultiWorkerReplicator(cluster=cluster)
