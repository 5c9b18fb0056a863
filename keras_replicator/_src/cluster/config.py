"""Cluster specs for multi-worker replicators: TF_CONFIG, Slurm or explicit.

TensorFlow reads jobs of `host:port` addresses and this process's task from
`TF_CONFIG`, e.g. `{"cluster": {"worker": ["10.0.0.1:2222",
"10.0.0.2:2222"]}, "task": {"type": "worker", "index": 0}}`. Its resolver
accepts malformed specs silently and fails later, often as a hang;
`parse_tf_config` validates every field up front and names the wrong one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from keras_replicator._src.cluster import discovery
from keras_replicator._src.core import env
from keras_replicator._src.core import validation

TF_CONFIG = env.TF_CONFIG
# Jobs of a synchronous cluster; "ps" belongs to the parameter-server backend.
JOB_TYPES = ("chief", "worker", "ps", "evaluator")
_CLUSTER_HELP = (
    'TF_CONFIG must look like {"cluster": {"worker": ["host1:port", '
    '"host2:port"]}, "task": {"type": "worker", "index": 0}}.'
)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster: every job's addresses and this process's task.

    Attributes:
        cluster: Job name -> list of `host:port` addresses, one per task.
        task_type: This process's job, e.g. `"worker"`.
        task_index: This process's index within its job, from 0.
        launcher: `"slurm"` or `"mpi"` when discovered from a launcher's
            environment, else None.
        local_rank: This process's index among the workers of its host
            (from Slurm or MPI; 0 otherwise).
        local_size: The number of workers on this host (1 if unknown).
    """

    cluster: Mapping[str, Sequence[str]]
    task_type: str
    task_index: int
    # Set when Slurm or MPI started this process (see `discovery`).
    launcher: str | None = None
    local_rank: int = 0
    local_size: int = 1

    @property
    def num_workers(self) -> int:
        """Tasks that hold replicas: the chief (if any) and the workers."""
        return len(self.cluster.get("chief", ())) + len(
            self.cluster.get("worker", ())
        )

    @property
    def worker_index(self) -> int:
        """This task's index among chief + workers (the chief is 0)."""
        if self.task_type == "chief":
            return 0
        return len(self.cluster.get("chief", ())) + self.task_index

    @property
    def is_chief(self) -> bool:
        """Whether this task is the chief: "chief" 0, else "worker" 0."""
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    def to_dict(self) -> dict[str, Any]:
        """The TF_CONFIG dictionary."""
        return {
            "cluster": {job: list(a) for job, a in self.cluster.items()},
            "task": {"type": self.task_type, "index": self.task_index},
        }

    def to_json(self) -> str:
        """The TF_CONFIG string."""
        return json.dumps(self.to_dict())

    def resolver(self):
        """A `tf.distribute.cluster_resolver.SimpleClusterResolver`."""
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.to_dict()["cluster"]),
            task_type=self.task_type,
            task_id=self.task_index,
            rpc_layer="grpc",
        )


def parse_tf_config(config: str | Mapping[str, Any]) -> ClusterConfig:
    """Parses and validates a TF_CONFIG (JSON text or its dict).

    Raises `ValueError`, quoting the bad field, on malformed JSON, a missing
    or misshapen `cluster` or `task`, a task type not in the cluster, an
    index out of range, or an address malformed or repeated.
    """
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"TF_CONFIG is not valid JSON ({e}). {_CLUSTER_HELP} "
                f"Received: TF_CONFIG={config!r}"
            ) from None
    if not isinstance(config, Mapping):
        raise ValueError(
            f"TF_CONFIG must be a JSON object. {_CLUSTER_HELP} "
            f"Received: TF_CONFIG={config!r}"
        )
    cluster = config.get("cluster")
    if not isinstance(cluster, Mapping) or not cluster:
        raise ValueError(
            "TF_CONFIG needs a non-empty `cluster` object mapping job names to "
            f"address lists. {_CLUSTER_HELP} Received: cluster={cluster!r}"
        )
    seen: dict[str, str] = {}
    for job, addresses in cluster.items():
        if job not in JOB_TYPES:
            raise ValueError(
                f"Each job of `cluster` must be one of {JOB_TYPES}. "
                f"Received: cluster[{job!r}]"
            )
        if (
            isinstance(addresses, str)
            or not isinstance(addresses, Sequence)
            or not addresses
        ):
            raise ValueError(
                f"`cluster[{job!r}]` must be a non-empty list of 'host:port' "
                f"addresses. Received: cluster[{job!r}]={addresses!r}"
            )
        for i, address in enumerate(addresses):
            field = f"cluster[{job!r}][{i}]"
            _check_address(field, address)
            if address in seen:
                raise ValueError(
                    "Every task needs its own address; "
                    f"{field} repeats {seen[address]}. "
                    f"Received: {field}={address!r}"
                )
            seen[address] = field
    if "chief" in cluster and len(cluster["chief"]) != 1:
        raise ValueError(
            "A cluster has at most one chief. "
            f"Received: cluster['chief']={list(cluster['chief'])!r}"
        )

    task = config.get("task")
    if not isinstance(task, Mapping):
        raise ValueError(
            "TF_CONFIG needs a `task` object naming this process's job and "
            f"index. {_CLUSTER_HELP} Received: task={task!r}"
        )
    task_type = task.get("type")
    if task_type not in cluster:
        raise ValueError(
            f"`task.type` must be a job of the cluster, one of "
            f"{tuple(cluster)}. Received: task.type={task_type!r}"
        )
    index = task.get("index", 0)
    if not validation.is_int(index):
        raise ValueError(
            f"`task.index` must be an integer. Received: task.index={index!r}"
        )
    if not 0 <= index < len(cluster[task_type]):
        raise ValueError(
            f"`task.index` must be in [0, {len(cluster[task_type])}) for job "
            f"{task_type!r}, which has {len(cluster[task_type])} task(s). "
            f"Received: task.index={index}"
        )
    return ClusterConfig(
        cluster={job: tuple(a) for job, a in cluster.items()},
        task_type=task_type,
        task_index=index,
    )


def _check_address(field: str, address: object) -> None:
    if not isinstance(address, str):
        raise ValueError(
            f"Each address must be a 'host:port' string. "
            f"Received: {field}={address!r}"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            "Each address must be 'host:port' with a port in [1, 65535]. "
            f"Received: {field}={address!r}"
        )


def make_tf_config(
    hosts: Sequence[str], index: int, task_type: str = "worker"
) -> ClusterConfig:
    """The validated `ClusterConfig` of task `index` of `hosts` (`host:port`).

    `.to_json()` is the TF_CONFIG value; raises as `parse_tf_config`.
    """
    return parse_tf_config(
        {
            "cluster": {task_type: list(hosts)},
            "task": {"type": task_type, "index": index},
        }
    )


def detect(environ: Mapping[str, str] | None = None) -> str | None:
    """Names the cluster environment present: "TF_CONFIG", "Slurm", "MPI".

    In that order of precedence (see `discovery`), else None; a TF_CONFIG
    without a cluster (TensorFlow accepts `{}`) counts as none. `environ`
    defaults to `os.environ`. Raises `ValueError` if Slurm or MPI variables
    are inconsistent.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(TF_CONFIG, "").strip()
    if text:
        try:
            has_cluster = bool(json.loads(text).get("cluster"))
        except (json.JSONDecodeError, AttributeError):
            # Present, so the replicator's parse names the bad field.
            has_cluster = True
        if has_cluster:
            return TF_CONFIG
    found = discovery.detect(environ)
    if found is not None:
        return {"slurm": "Slurm", "mpi": "MPI"}[found.launcher]
    return None


def has_ps_tasks(environ: Mapping[str, str] | None = None) -> bool:
    """Whether TF_CONFIG names parameter servers (an asynchronous cluster)."""
    environ = os.environ if environ is None else environ
    try:
        cluster = json.loads(environ.get(TF_CONFIG) or "{}").get("cluster")
    except (json.JSONDecodeError, AttributeError):
        return False
    return isinstance(cluster, Mapping) and bool(cluster.get("ps"))


def resolve(cluster: Any = None):
    """Turns `cluster` (or the environment) into `(resolver, ClusterConfig)`.

    `cluster` is None (read TF_CONFIG, else Slurm or MPI), a TF_CONFIG
    string or dict, a `ClusterConfig` or a TF `ClusterResolver`. Raises
    `ValueError` if none is given or found, or it is malformed, and
    `TypeError` for another type.
    """
    import tensorflow as tf

    if cluster is None:
        found = detect()
        if found == TF_CONFIG:
            cluster = os.environ[TF_CONFIG]
        elif found in ("Slurm", "MPI"):
            # Not TF's SlurmClusterResolver: no `scontrol` needed, and MPI.
            launched = discovery.exchange_addresses(discovery.detect())
            config = parse_tf_config(launched.tf_config())
            config = dataclasses.replace(
                config,
                launcher=launched.launcher,
                local_rank=launched.local_rank,
                local_size=launched.local_size,
            )
            return config.resolver(), config
        else:
            raise ValueError(
                "No cluster found: set TF_CONFIG (or start the workers with "
                "`keras-replicator launch`), run under Slurm or mpiexec, or "
                "pass "
                "`cluster=`. For one host, use `LocalReplicator`. "
                "Received: cluster=None"
            )
    if isinstance(cluster, tf.distribute.cluster_resolver.ClusterResolver):
        config = parse_tf_config(
            {
                "cluster": cluster.cluster_spec().as_dict(),
                "task": {"type": cluster.task_type, "index": cluster.task_id},
            }
        )
        return cluster, config
    if isinstance(cluster, ClusterConfig):
        config = cluster
    elif isinstance(cluster, (str, Mapping)):
        config = parse_tf_config(cluster)
    else:
        raise TypeError(
            "`cluster` must be None, a TF_CONFIG string or dict, a "
            "ClusterConfig or a tf.distribute.cluster_resolver."
            f"ClusterResolver. Received: cluster={cluster!r} "
            f"(of type {type(cluster).__name__})"
        )
    return config.resolver(), config
