"""MultiWorkerReplicator: synchronous replication over worker processes."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import tensorflow as tf

from keras_replicator._src import collectives
from keras_replicator._src import mpi_collectives
from keras_replicator._src.cluster import config as cluster_lib
from keras_replicator._src.cluster import process_layout
from keras_replicator._src.cluster import startup_watchdog
from keras_replicator._src.cluster import transport as transport_lib
from keras_replicator._src.core import devices as devices_lib
from keras_replicator._src.core import env
from keras_replicator._src.core import validation
from keras_replicator._src.patches import plain_iterator
from keras_replicator._src.replicators import base
from keras_replicator._src.training import hang_watchdog
from keras_replicator._src.upstream import cars

_Extended = cars.CollectiveAllReduceExtended
_CPU_REPLICAS_ENV = env.CPU_REPLICAS


class MultiWorkerReplicator(
    base.ReplicatorMixin, tf.distribute.MultiWorkerMirroredStrategy
):
    """Replicates Keras and TensorFlow code over worker processes.

    The paper's `MultiWorkerReplicator`: between-graph, synchronous data
    parallelism. Every worker runs the same program with
    `replicas_per_worker` replicas (GPUs or logical CPUs); gradients are
    all-reduced over all replicas with TF's collective ops over gRPC. It is a
    `tf.distribute.MultiWorkerMirroredStrategy`: Keras code needs only
    `with replicator.scope():` (Keras 3 fixes: `patches/keras_compat.py`).

    The cluster comes from `TF_CONFIG` (`keras-replicator launch`, Kubeflow's
    TFJob, or by hand), Slurm, or `cluster=`. Workers must create as many
    multi-worker replicators (each takes the next collective key block).
    Creating one again (keras.io's multi-worker guide does, per
    `run_training()`) reuses the worker's collective server; see
    `_MultiWorkerExtended`. TF's gRPC traffic is unauthenticated: keep the
    cluster on a trusted network.

    Args:
        cluster: `None` to read `TF_CONFIG` (else Slurm), a TF_CONFIG JSON
            string or dict, a `keras_replicator.ClusterConfig`,
            or a `tf.distribute.cluster_resolver.ClusterResolver`.
        replicas_per_worker: Replicas per worker, the same on every worker.
            Defaults to all local GPUs, else `KERAS_REPLICATOR_CPU_REPLICAS`
            if set, else 1.
        timeout_seconds: Bound on start-up's wait for the other workers
            (then the worker ends, naming the unreachable peer). Defaults to
            60; `None` waits forever. A worker dying later is reported by
            TF's coordination-service heartbeats within about 10 s anyway.
        collective_timeout_seconds: Bound on each collective, for a peer
            alive but stuck. Defaults to `None` (none). TF spends a sleeping
            thread per collective for the whole timeout (100 steps/s with a
            60 s bound: 12,000 threads), and a step that legitimately waits
            longer (the chief saving a large checkpoint) fails. For debugging;
            `hang_seconds` catches hangs at no cost per step.
        gradient_reduction: As in `LocalReplicator`. Defaults to `"auto"`.
        hang_seconds: After this many seconds without a finished step in
            `fit`, `evaluate`, `predict` or `replicate`, the worker prints
            every thread's stack and exits with code 76 (restarted by
            `keras-replicator launch --max-restarts`). A loop's first step
            and checkpoint saves (anyone's) get up to 5 times the timeout; a
            stall warning names the workers behind. 0 turns it off.
            Defaults to None: `KERAS_REPLICATOR_HANG_SECONDS`, else 600.
        sync_batch_norm: As in `LocalReplicator`. Defaults to True.
        shard_optimizer_state: ZeRO stage 1 (see `LocalReplicator`);
            checkpoints gather the full state from every worker, so every
            worker must save (as `fit`'s callbacks do). Defaults to False.

    Raises:
        ValueError: If the cluster is missing or malformed (naming the bad
            TF_CONFIG field), or an argument is out of range.
        TypeError: If `cluster` has an unsupported type.
        RuntimeError: If CPU replicas are wanted but TensorFlow already
            initialised too few logical CPU devices.
    """

    replicator_kind = "multi_worker"

    def __init__(
        self,
        cluster: Any = None,
        replicas_per_worker: int | None = None,
        timeout_seconds: float | None = 60,
        collective_timeout_seconds: float | None = None,
        gradient_reduction: str = "auto",
        hang_seconds: float | None = None,
        shard_optimizer_state: bool = False,
        sync_batch_norm: bool = True,
    ):
        self._set_options(
            gradient_reduction,
            sync_batch_norm,
            hang_seconds,
            shard_optimizer_state,
        )
        validation.check_positive_int(
            "replicas_per_worker", replicas_per_worker, allow_none=True
        )
        _check_timeout("timeout_seconds", timeout_seconds)
        _check_timeout("collective_timeout_seconds", collective_timeout_seconds)
        resolver, config = cluster_lib.resolve(cluster)
        if config.task_type not in ("chief", "worker"):
            raise ValueError(
                "MultiWorkerReplicator runs on the chief and worker tasks. "
                f"Received: task.type={config.task_type!r}"
            )
        _check_collectives_configurable(config)
        self._cluster_config = config
        self._timeout_seconds = timeout_seconds
        self._collective_timeout_seconds = collective_timeout_seconds
        _take_gpu_share(config)
        device_type, count = _local_devices(replicas_per_worker)
        self._transport = transport_lib.choose(replicas_per_process=count)
        # Read by CollectiveAllReduceExtended (base.next_collective_key_base);
        # a LocalReplicator on one worker alone does not shift the keys.
        self._collective_key_base = base.next_collective_key_base(
            multi_worker=True
        )
        # Dead peers: coordination-service heartbeats (10 s, names the task);
        # peers never up: the start-up watchdog. Per-collective timeout costs
        # a thread per collective (see the docstring): opt-in.
        options = tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=collective_timeout_seconds
        )
        # Chief-only files and progress bars, one all-reduce for logs, ...
        self._install_patches()
        # TF blocks forever (ignoring SIGTERM) on a peer that never comes up;
        # the watchdog exits naming it.
        cluster = config.cluster
        me = cluster[config.task_type][config.task_index]
        with startup_watchdog.bounded_startup(cluster, me, timeout_seconds):
            extended = _MultiWorkerExtended(
                self, resolver, options, device_type=device_type, count=count
            )
        if self._transport.name == transport_lib.MPI:
            mpi_collectives.install(extended, collective_timeout_seconds)
        # Skip MultiWorkerMirroredStrategy.__init__: its extended object
        # places only one replica per CPU worker.
        tf.distribute.Strategy.__init__(self, extended)
        process_layout.advise_once(config, device_type, count)
        _say_transport_once(config, self._transport)
        if not config.is_chief:
            # Keras' and TF's warnings only in the chief's output, not the
            # same ones from every worker (`shuffle=True ... ignored`); the
            # program's and this package's still print everywhere.
            warnings.filterwarnings("ignore", module=_UPSTREAM_MODULES)

    def reduce(self, reduce_op, value, axis=None):
        """Reduces `value` across every replica of every worker.

        Like `tf.distribute.Strategy.reduce`, plus what Keras 3's trainer
        needs (`patches/keras_compat.py`): `value` may be a nest (leaves
        reduced in `tf.nest.flatten` order, the same on every worker; float
        scalar leaves in one all-reduce per dtype), and a scalar leaf with
        `axis=0` is reduced across replicas only.

        Args:
            reduce_op: `"SUM"`, `"MEAN"` or a `tf.distribute.ReduceOp`.
            value: `tf.distribute.DistributedValues`, tensors, or a nest.
            axis: The dimension to reduce within each replica, or `None`.

        Returns:
            A tensor, or a nest of tensors shaped like `value`.
        """
        parent = super()
        leaves = tf.nest.flatten(value, expand_composites=False)
        if len(leaves) == 1 and leaves[0] is value:
            return parent.reduce(reduce_op, value, _leaf_axis(value, axis))
        reduced = collectives.reduce_scalars(
            parent.reduce, reduce_op, leaves, len(self.extended.worker_devices)
        )
        for i, leaf in enumerate(leaves):
            if reduced[i] is None:
                reduced[i] = parent.reduce(
                    reduce_op, leaf, _leaf_axis(leaf, axis)
                )
        return tf.nest.pack_sequence_as(value, reduced)

    @property
    def transport(self) -> str:
        """`"grpc"` or `"mpi"`: what carries the collectives between processes.

        MPI when `mpiexec`/`srun --mpi` started one replica per process and
        mpi4py imports, or `KERAS_REPLICATOR_TRANSPORT` forces it; else gRPC.
        The chief prints which, and why, at the first replicator.
        """
        return self._transport.name

    @property
    def is_chief(self) -> bool:
        """True on exactly one process: the chief, else worker 0."""
        return self._cluster_config.is_chief

    @property
    def num_workers(self) -> int:
        """The number of worker processes (chief included)."""
        return self._cluster_config.num_workers

    @property
    def worker_index(self) -> int:
        """This process's index among the workers; the chief is 0."""
        return self._cluster_config.worker_index

    @property
    def cluster_config(self) -> cluster_lib.ClusterConfig:
        """The validated cluster this replicator belongs to."""
        return self._cluster_config

    @property
    def timeout_seconds(self) -> float | None:
        """The start-up bound in seconds (None: none)."""
        return self._timeout_seconds

    @property
    def collective_timeout_seconds(self) -> float | None:
        """The bound on each collective in seconds (None: none)."""
        return self._collective_timeout_seconds


_said_transport = False


# Modules that Keras' and TensorFlow's warnings are attributed to.
_UPSTREAM_MODULES = r"(keras|tensorflow|tf_keras|keras_hub)(\.|$)"


def _say_transport_once(config, choice) -> None:
    """The chief's first line: which transport, and why (once a process)."""
    global _said_transport
    if _said_transport or not config.is_chief:
        return
    _said_transport = True
    print(f"keras-replicator {choice.describe()}", file=sys.stderr, flush=True)


def _check_collectives_configurable(config: cluster_lib.ClusterConfig):
    """Raises if TensorFlow started before its collectives were configured.

    TF configures cross-worker collectives (and starts the server) only
    before its runtime starts, else raises a bare "Collective ops must be
    configured at program startup"; this raises a RuntimeError with the fix.
    """
    from keras_replicator._src.upstream import context

    # An earlier MultiWorkerReplicator configured them; reuse its set-up.
    configured = context.context()._collective_leader is not None  # noqa: SLF001
    if configured or not devices_lib.runtime_started():
        return
    raise RuntimeError(
        "MultiWorkerReplicator() must be created before TensorFlow runs its "
        "first op: it configures TensorFlow's cross-worker collectives, "
        "which TensorFlow allows only at program start-up, and this program "
        "already ran TensorFlow code (a tensor, a dataset, a model or "
        "a one-device reference run). `import keras_replicator` first is not "
        "enough here: the cluster is set up when the replicator is created. "
        "Fix: create the replicator (`kr.MultiWorkerReplicator()` or "
        "`kr.auto()`) right after the imports, then run other TensorFlow "
        "code, one-device references included (outside "
        "`replicator.scope()` they run on this worker alone). Received: "
        "TensorFlow already started on task "
        f"{config.task_type}:{config.task_index}"
    )


def _leaf_axis(value, axis):
    """`None` for a scalar value: it has no axis 0 to reduce within."""
    if axis is None:
        return None
    first = value
    if isinstance(value, tf.distribute.DistributedValues):
        first = value.values[0]
    rank = getattr(getattr(first, "shape", None), "rank", None)
    return None if rank == 0 else axis


def _check_timeout(name: str, value: Any) -> None:
    validation.check_positive_number(name, value, allow_none=True, finite=True)


class _MultiWorkerExtended(plain_iterator.PlainInputExtended, _Extended):
    """Places `count` replicas of `device_type` on each worker.

    CPU replicas read batches in turns from one plain iterator
    (`patches/plain_iterator.py`).

    A replicator created again keeps an already running collective server.
    TF would re-enable collective ops (`context.enable_collective_ops`), and
    `UpdateServerDef` replaces the collective executor manager and its group
    table. A worker doing so after a peer's first collective (the first
    variable's initial-value broadcast) reached it loses that request: both
    wait forever (`collective_bcast_send` / `collective_bcast_recv`, same
    keys). The new replicator's groups are just new keys in that manager.
    """

    def __init__(self, container, resolver, options, device_type, count):
        self._kr_device_type = device_type
        self._kr_count = count
        if _server_running_for(resolver):
            # Skips TF's server set-up (`_initialize_multi_worker` checks
            # this) and, as TF does under the coordination service, its
            # health-check thread and the all-reduce it opens with.
            self._std_server_started = True
            self._enable_check_health = False
        super().__init__(container, resolver, options)

    def _create_variable(self, next_creator, **kwargs):
        # Eagerly the chief broadcasts the initial value: a collective,
        # watched for a hang like a step (a worker never building the model).
        name = kwargs.get("name")
        what = "the creation of " + (
            f"variable {name!r}" if name else "a variable"
        )
        with hang_watchdog.CollectiveWatch(
            self._container_strategy(),
            f"{what} (its initial value's broadcast from the chief)",
        ):
            return super()._create_variable(next_creator, **kwargs)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        # TF places one replica per CPU worker; logical CPUs need a list.
        del cluster_resolver
        devices = tuple(
            f"{worker_device}/device:{self._kr_device_type}:{i}"
            for i in range(self._kr_count)
        )
        return devices, self._kr_device_type


def _server_running_for(resolver) -> bool:
    """Whether this process's collective server runs, for this cluster."""
    from keras_replicator._src.upstream import context

    ctx = context.context()
    running = ctx._collective_ops_server_def  # noqa: SLF001
    if running is None or ctx._context_handle is None:  # noqa: SLF001
        return False
    # A different cluster (another `cluster=`) keeps TensorFlow's path.
    return (
        running.cluster == resolver.cluster_spec().as_cluster_def()
        and running.job_name == resolver.task_type
        and running.task_index == resolver.task_id
    )


def _take_gpu_share(config: cluster_lib.ClusterConfig) -> None:
    """Under Slurm or MPI, each of a host's workers takes its own GPUs.

    With G GPUs and L workers on a host, local rank r sees GPUs
    [r * G // L, (r + 1) * G // L). Untested here: this machine has no GPU.
    """
    physical = tf.config.list_physical_devices("GPU")
    if config.local_size <= 1 or not physical:
        return
    share = len(physical) // config.local_size
    if share < 1:
        raise ValueError(
            f"This host has {len(physical)} GPU(s) for {config.local_size} "
            "workers; start at most one worker per GPU. Received: "
            f"local_size={config.local_size}"
        )
    start = config.local_rank * share
    tf.config.set_visible_devices(physical[start : start + share], "GPU")


def _local_devices(replicas_per_worker: int | None) -> tuple[str, int]:
    gpus = devices_lib.local_gpus()
    if gpus:
        if replicas_per_worker is not None and replicas_per_worker > len(gpus):
            raise ValueError(
                f"This worker has {len(gpus)} GPU(s), fewer than the replicas "
                "asked for. Received: "
                f"replicas_per_worker={replicas_per_worker}"
            )
        return "GPU", replicas_per_worker or len(gpus)
    if replicas_per_worker is None:
        # One CPU replica unless asked (`launch --replicas-per-worker` sets
        # the variable): workers usually share a host's cores already.
        replicas_per_worker = (
            devices_lib.default_cpu_replicas()
            if os.environ.get(_CPU_REPLICAS_ENV)
            else 1
        )
    devices_lib.configure_cpu_replicas(replicas_per_worker)
    return "CPU", replicas_per_worker
