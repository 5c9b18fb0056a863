"""`keras.distribution.initialize()` on TensorFlow: one process per worker.

On JAX, `initialize` connects a job's processes and later meshes span all
their devices. Here it finds (or builds) the cluster, starts this process's
TensorFlow server via a `MultiWorkerReplicator` (before TensorFlow's first
op) and records the process count, index and every worker's devices, so
`list_devices()` is global and `num_processes()`/`process_id()` are real.
No collective runs: the arguments are checked first (`ValueError` naming
the numbers), then the server waits for its peers (bounded by the
replicator's start-up timeout).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from keras_replicator._src.cluster import config as cluster_lib
from keras_replicator._src.cluster import discovery
from keras_replicator._src.core import validation


@dataclasses.dataclass(frozen=True)
class Processes:
    """The processes `initialize` joined, with their device count and type."""

    cluster: cluster_lib.ClusterConfig
    replicas_per_worker: int
    device_type: str

    @property
    def num_processes(self) -> int:
        return self.cluster.num_workers

    @property
    def process_id(self) -> int:
        return self.cluster.worker_index

    def tasks(self) -> list[tuple[str, int]]:
        """`(job, index)` of every process, in replica order."""
        jobs = [
            ("chief", i)
            for i in range(len(self.cluster.cluster.get("chief", ())))
        ]
        jobs += [
            ("worker", i)
            for i in range(len(self.cluster.cluster.get("worker", ())))
        ]
        return jobs

    def devices(self) -> list[str]:
        """Every process's devices, in replica order (`/job:.../cpu:0`)."""
        return [
            f"/job:{job}/task:{task}/{self.device_type}:{i}"
            for job, task in self.tasks()
            for i in range(self.replicas_per_worker)
        ]


_state: list[Processes] = []
# The replicator `initialize` made (it started this process's server).
_replicators: list[Any] = []
# `cluster -> MultiWorkerReplicator`, set by `api.enable` (`runtime.py`,
# which makes replicators, imports this module).
_factory: Any = None


def set_replicator_factory(factory: Any) -> None:
    """Registers `factory(cluster_config) -> MultiWorkerReplicator`."""
    global _factory
    _factory = factory


def current() -> Processes | None:
    """The processes `initialize` joined, or None (one process)."""
    return _state[0] if _state else None


def cluster_from_arguments(
    job_addresses: Any, num_processes: Any, process_id: Any
) -> cluster_lib.ClusterConfig | None:
    """The `ClusterConfig` Keras' `initialize` arguments describe, or None.

    None for a single process; ValueError naming inconsistent arguments.
    """
    if num_processes is not None:
        validation.check_positive_int("num_processes", num_processes)
    if process_id is not None and (
        not validation.is_int(process_id) or process_id < 0
    ):
        raise ValueError(
            "`process_id` must be an integer >= 0. "
            f"Received: process_id={process_id!r}"
        )
    if isinstance(job_addresses, str):
        addresses = [a.strip() for a in job_addresses.split(",") if a.strip()]
    elif job_addresses is None:
        addresses = []
    else:
        addresses = [str(a) for a in job_addresses]
    if num_processes is None:
        num_processes = len(addresses) or None
    if process_id is not None and process_id >= (num_processes or 1):
        raise ValueError(
            "`process_id` must be below `num_processes`. Received: "
            f"process_id={process_id}, num_processes={num_processes}"
        )
    if num_processes is None or num_processes == 1:
        return None
    if process_id is None:
        raise ValueError(
            "`process_id` is needed with several processes (or set "
            "KERAS_DISTRIBUTION_PROCESS_ID). Received: process_id=None, "
            f"num_processes={num_processes}"
        )
    if len(addresses) != num_processes:
        raise ValueError(
            "`job_addresses` must give one 'host:port' per process (on "
            "TensorFlow every process listens on its own address). "
            f"Received: {len(addresses)} job_addresses={job_addresses!r}, "
            f"num_processes={num_processes}"
        )
    return cluster_lib.make_tf_config(addresses, process_id)


def _found_in_environment() -> tuple[int, int] | None:
    """`(processes, this one)` from TF_CONFIG, Slurm or MPI, or None."""
    found = cluster_lib.detect()
    if found == cluster_lib.TF_CONFIG:
        config = cluster_lib.parse_tf_config(os.environ[cluster_lib.TF_CONFIG])
        return config.num_workers, config.worker_index
    if found is not None:
        launched = discovery.detect()
        return launched.size, launched.rank
    return None


def initialize(
    job_addresses: Any = None, num_processes: Any = None, process_id: Any = None
) -> None:
    """Joins this process to its cluster (see the module docstring).

    Without `job_addresses` the cluster is what `keras-replicator launch`,
    `TF_CONFIG`, Slurm or mpiexec describe (given `num_processes` and
    `process_id` must agree); else the arguments describe it; without
    those, one process: nothing happens. Raises ValueError if arguments are
    inconsistent or disagree with an earlier call.
    """
    found = _found_in_environment() if job_addresses is None else None
    if found is not None:
        # The launcher's cluster; Keras' counts, if given, must agree.
        size, rank = found
        if num_processes not in (None, size) or process_id not in (None, rank):
            raise ValueError(
                "`num_processes`/`process_id` disagree with the cluster "
                f"found here ({size} processes, this one {rank}). Received: "
                f"num_processes={num_processes}, process_id={process_id}"
            )
        config = None  # The replicator resolves the environment.
    else:
        config = cluster_from_arguments(
            job_addresses, num_processes, process_id
        )
        if config is None:
            return
    if _state:
        joined = _state[0].cluster
        if config is not None and (
            dict(config.cluster) != dict(joined.cluster)
            or config.task_index != joined.task_index
        ):
            raise ValueError(
                "`initialize` was already called with another cluster. "
                f"Received: cluster={config.to_dict()}, earlier "
                f"cluster={joined.to_dict()}"
            )
        return
    if config is not None and not os.environ.get(cluster_lib.TF_CONFIG):
        # So TensorFlow's and our multi-worker helpers find the cluster.
        os.environ[cluster_lib.TF_CONFIG] = config.to_json()
    if _factory is None:
        raise RuntimeError(
            "keras_replicator's distribution runtime is not loaded; "
            "`import keras_replicator` first."
        )
    replicator = _factory(config)
    devices = replicator.extended.worker_devices
    _replicators.append(replicator)
    _state.append(
        Processes(
            cluster=replicator.cluster_config,
            replicas_per_worker=len(devices),
            device_type="gpu" if "GPU" in devices[0].upper() else "cpu",
        )
    )
