"""auto(): picks the replicator for the hardware and cluster at hand."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING
from typing import Any

from keras_replicator._src.cluster import config as cluster_lib
from keras_replicator._src.cluster import process_layout
from keras_replicator._src.core import devices as devices_lib

if TYPE_CHECKING:
    import tensorflow as tf

# Why one host gets one process, in `keras-replicator env`'s explanation.
_ONE_PROCESS = (
    "one process with every replica, not a worker process per replica: "
    "replicas in one process all-reduce in memory, worker processes over "
    "gRPC (" + process_layout.MEASURED + ")"
)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `auto()` would create, and why."""

    backend: str
    kwargs: dict[str, Any]
    reason: str

    def describe(self) -> str:
        """One line: the call auto() makes, then why."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.backend}({args}): {self.reason}"


def choose() -> Choice:
    """Decides, as a `Choice`, which backend `auto()` creates.

    TPU, then a cluster (TF_CONFIG or Slurm), local GPUs, CPU replicas.
    Needs no TensorFlow where no GPU can be (`devices.gpus_possible`), so
    `keras-replicator env` is quick there.
    """
    tpu = devices_lib.find_tpu()
    if tpu:
        return Choice(
            "TpuReplicator",
            {"tpu": tpu},
            f"found a TPU ({tpu!r}, from TPU_NAME, COLAB_TPU_ADDR or local "
            "TPU chips)",
        )
    found = cluster_lib.detect()
    if found and cluster_lib.has_ps_tasks():
        return Choice(
            "AsyncReplicator",
            {},
            f"found a {found} cluster with parameter servers: asynchronous "
            "training coordinated by the chief",
        )
    if found:
        return Choice(
            "MultiWorkerReplicator",
            {},
            f"found a {found} cluster: synchronous replication over its "
            "worker processes",
        )
    gpus = devices_lib.local_gpus()
    if gpus:
        return Choice(
            "LocalReplicator",
            {"num_replicas": len(gpus)},
            f"found {len(gpus)} local GPU(s): {gpus}; {_ONE_PROCESS}",
        )
    count = devices_lib.default_cpu_replicas()
    return Choice(
        "LocalReplicator",
        {"num_replicas": count},
        f"no GPU, TPU or cluster found; {count} CPU replica(s) from "
        "KERAS_REPLICATOR_CPU_REPLICAS or the CPU core count (at most "
        f"{devices_lib.MIN_LOGICAL_CPUS}); {_ONE_PROCESS}",
    )


def auto() -> tf.distribute.Strategy:
    """Creates the best replicator for this machine.

    TPU > TF_CONFIG/Slurm cluster > local GPUs > CPU replicas. A cluster
    with `ps` tasks gets an `AsyncReplicator` (parameter servers, training
    coordinated by the chief); one without, a `MultiWorkerReplicator`. Run
    `keras-replicator env` to see what it picks here, and why.

    Returns:
        A replicator (a `tf.distribute.Strategy` subclass).
    """
    from keras_replicator._src.replicators.async_ps import AsyncReplicator
    from keras_replicator._src.replicators.local import LocalReplicator
    from keras_replicator._src.replicators.multi_worker import (
        MultiWorkerReplicator,
    )
    from keras_replicator._src.replicators.tpu import TpuReplicator

    backends = {
        "AsyncReplicator": AsyncReplicator,
        "LocalReplicator": LocalReplicator,
        "MultiWorkerReplicator": MultiWorkerReplicator,
        "TpuReplicator": TpuReplicator,
    }
    choice = choose()
    return backends[choice.backend](**choice.kwargs)
