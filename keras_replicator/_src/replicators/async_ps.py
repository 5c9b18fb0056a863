"""AsyncReplicator: asynchronous training with parameter servers.

The paper's `MultiWorkerAsyncReplicator`. Variables live on "ps" tasks; the
chief (coordinator) runs the user's program and dispatches steps to worker
tasks, which each read the variables, compute a step and apply its update
without waiting for the others. `tf.distribute.ParameterServerStrategy` with a
`ClusterCoordinator` does the work; this adds what Keras 3 lacks (`model.fit`
/`evaluate`, see `async_training`) and the research API.

Workers and ps tasks only serve: `serve()` (`SERVE_COMMAND`, used by
`keras-replicator launch --ps`), or the user's script, whose
`AsyncReplicator()` call serves and never returns.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import tensorflow as tf

from keras_replicator._src.cluster import config as cluster_lib
from keras_replicator._src.cluster import launch
from keras_replicator._src.core import validation
from keras_replicator._src.data import dataset_sharder
from keras_replicator._src.data import worker_shards
from keras_replicator._src.replicators import async_training
from keras_replicator._src.replicators import base
from keras_replicator._src.training import replicate as replicate_lib

# What a worker or ps process runs (`serve`; the launcher starts it by name).
SERVE_COMMAND = launch.SERVE_COMMAND
# Tasks that only serve; the chief (coordinator) runs the user's program.
_SERVER_JOBS = ("worker", "ps")
# Servers run the coordinator's functions on inter-op threads; with fewer
# (a 2-core machine) a step waiting on a ps read can starve the pool and stall.
_MIN_INTER_OP_THREADS = 4


class AsyncReplicator(
    base.ReplicatorMixin, tf.distribute.ParameterServerStrategy
):
    """Trains asynchronously: workers update variables on parameter servers.

    The cluster has one `"chief"` (the coordinator, running your program)
    and one or more `"worker"` and `"ps"` tasks. Variables created under
    `replicator.scope()` go to the parameter servers, round-robin or sharded
    by `variable_partitioner`. `model.fit` dispatches each step to a free
    worker; workers do not wait for each other, so a slow or dead worker's
    steps are rescheduled on the others.

    `replicator.distribute(examples, global_batch_size)` follows TF's
    parameter-server convention: a step runs on one worker and takes
    `global_batch_size` examples; `model.fit` of it needs no
    `steps_per_epoch` when the example count is known. `x` may also be a
    `tf.data.Dataset` of batches, an `input_fn(ctx)` returning one, or NumPy
    arrays with `batch_size` (one worker's step; pass `steps_per_epoch`):
    each worker iterates its own copy forever (shuffle without a fixed seed
    so workers' orders differ).

    On a `"worker"` or `"ps"` task the constructor serves forever, so one
    script runs on every task. TF's gRPC traffic is unauthenticated: keep the
    cluster on a trusted network.

    Example (on the chief; start the cluster with
    `keras-replicator launch --workers 2 --ps 1 -- python train.py`):
    ```python
    replicator = kr.AsyncReplicator()
    with replicator.scope():
        model = build_model()
        model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(dataset, epochs=3, steps_per_epoch=100)
    ```

    Args:
        cluster: `None` to read `TF_CONFIG`, a TF_CONFIG JSON string or
            dict, a `keras_replicator.ClusterConfig`, or a
            `tf.distribute.cluster_resolver.ClusterResolver`, with `"chief"`,
            `"worker"` and `"ps"` tasks.
        variable_partitioner: None (whole variables, round-robin), a
            `tf.distribute.experimental.partitioners.Partitioner`, or an
            integer `min_shard_bytes`: shard along the first axis into
            pieces of at least that many bytes, over at most all parameter
            servers (for large embeddings). Defaults to None.

    Raises:
        ValueError: If the cluster is missing or malformed, has no `"ps"`,
            `"worker"` or `"chief"` task, or `variable_partitioner` is an
            integer below 1.
        TypeError: If `cluster` or `variable_partitioner` has an
            unsupported type.
    """

    replicator_kind = "async"
    # Keras' fit/evaluate/predict loops (patches/trainer_loops.py).
    keras_loops = async_training

    def __init__(self, cluster: Any = None, variable_partitioner: Any = None):
        resolver, config = cluster_lib.resolve(cluster)
        check_async_cluster(config)
        partitioner = _partitioner(variable_partitioner, config)
        if config.task_type in _SERVER_JOBS:
            # The same script runs on every task; here it only serves.
            serve(config)
            sys.exit(0)  # pragma: no cover - serve() never returns
        self._config = config
        super().__init__(resolver, variable_partitioner=partitioner)
        # Starts one thread per worker pulling steps off a shared queue.
        self._coordinator = tf.distribute.coordinator.ClusterCoordinator(self)
        self._install_patches()

    @property
    def coordinator(self) -> tf.distribute.coordinator.ClusterCoordinator:
        """The `ClusterCoordinator` that dispatches steps to the workers."""
        return self._coordinator

    @property
    def cluster_config(self) -> cluster_lib.ClusterConfig:
        """The validated cluster this replicator runs on."""
        return self._config

    @property
    def is_chief(self) -> bool:
        """True: only the chief (the coordinator) runs the user's program."""
        return True

    @property
    def num_workers(self) -> int:
        """The number of worker tasks that run steps."""
        return len(self._config.cluster["worker"])

    @property
    def num_ps(self) -> int:
        """The number of parameter-server tasks that hold the variables."""
        return len(self._config.cluster["ps"])

    @property
    def worker_index(self) -> int:
        """0: the coordinator is the only process running user code."""
        return 0

    @property
    def replicas_per_worker(self) -> int:
        """Replicas of one step: one worker's GPUs, or 1 on CPU."""
        return self.num_replicas_in_sync

    def join(self) -> None:
        """Waits until every scheduled step has run.

        Raises:
            tf.errors.OpError: The first error a step raised, e.g. an
                `UnavailableError` when a parameter server died.
        """
        self._coordinator.join()

    def replicate(self, step_fn, input_fn, reduce="mean", steps_per_call=1):
        """Compiles one worker's step; each call dispatches it asynchronously.

        As `ReplicatorMixin.replicate`, but a call schedules the step on a
        free worker and returns at once; `fetch()` waits for the outputs,
        reduced over that worker's replicas; `replicator.join()` waits for
        every step. `input_fn(ctx)` is traced once, built on every worker,
        with `ctx.input_pipeline_id` 0: shuffle without a fixed seed rather
        than shard by it. The dataset is repeated so no copy runs out.

        Args:
            step_fn: One replica's step, called with that replica's batch.
            input_fn: Called with a `tf.distribute.InputContext`; returns a
                `tf.data.Dataset` of per-replica batches.
            reduce: `"mean"`, `"sum"` or None (a list, one output per
                replica of the worker). Defaults to `"mean"`.
            steps_per_call: Steps per call, in one closure. Defaults to 1.

        Returns:
            A callable; each call returns a
            `tf.distribute.experimental.coordinator.RemoteValue`.

        Raises:
            TypeError: If `step_fn` or `input_fn` is not callable.
            ValueError: If `reduce` or `steps_per_call` is not supported.
        """
        return AsyncReplicatedStep(
            self, step_fn, input_fn, reduce, steps_per_call
        )

    def distribute(
        self,
        dataset_or_input_fn: Any,
        global_batch_size: int,
        *,
        shuffle_seed: int | None = None,
        static_shapes: bool | None = None,
        mode: str = "train",
        shuffle_buffer_size: int = dataset_sharder.DEFAULT_SHUFFLE_BUFFER_SIZE,
    ) -> worker_shards.WorkerShardedInput:
        """Shards, shuffles and batches unbatched examples over the workers.

        With TF's parameter-server meaning of the batch: a step runs on one
        worker and takes `global_batch_size` examples (split over its GPUs; 1
        replica on CPU). Worker `i` of `W` reads examples `i`, `i + W`, ...,
        shuffles them with `shuffle_seed` (a new order each pass) and repeats
        forever.

        With a known example count `N`, `model.fit` needs no
        `steps_per_epoch`: an epoch is `N // global_batch_size` steps, as in
        one synchronous epoch. `model.evaluate` of an eval-mode result runs
        on the chief over every example once, in batches of
        `global_batch_size` (with `steps=`, that many steps on the workers).

        Args:
            dataset_or_input_fn: A `tf.data.Dataset` of unbatched examples
                (sent to the workers as a graph), or a function of a
                `tf.distribute.InputContext` returning one, called on every
                worker; either is sharded.
            global_batch_size: Examples of one step (on one worker).
            shuffle_seed: Seed for shuffling each worker's shard. Defaults to
                None: the dataset's order.
            static_shapes: Ignored (accepted for portable scripts): training
                batches are always full (a pass's last partial batch wraps
                into the next) and evaluation runs on the chief. Defaults to
                None.
            mode: `"train"` or `"eval"` (elements become
                `(x, y, sample_weight)`). Defaults to `"train"`.
            shuffle_buffer_size: In examples. Defaults to 10,000.

        Returns:
            A `WorkerShardedInput` for `model.fit`, `evaluate`, `predict`.

        Raises:
            ValueError: If `mode` or a size is out of range, or
                `global_batch_size` does not divide over a worker's replicas.
            TypeError: If `dataset_or_input_fn` is neither a dataset nor
                callable.
        """
        del static_shapes  # See the docstring.
        validation.check_positive_int("global_batch_size", global_batch_size)
        replicas = self.num_replicas_in_sync
        if global_batch_size % replicas:
            raise ValueError(
                "The global batch size (of one step on one worker) must be "
                f"divisible by the worker's replicas ({replicas}). Received: "
                f"global_batch_size={global_batch_size}, "
                f"num_replicas_in_sync={replicas}"
            )
        return worker_shards.WorkerShardedInput(
            dataset_or_input_fn,
            global_batch_size,
            shuffle_seed=shuffle_seed,
            mode=mode,
            shuffle_buffer_size=shuffle_buffer_size,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_workers={self.num_workers}, "
            f"num_ps={self.num_ps})"
        )


class AsyncReplicatedStep(replicate_lib.ReplicatedStep):
    """A step that each call schedules on a free worker; see `replicate`."""

    def __init__(self, strategy, step_fn, input_fn, reduce, steps_per_call):
        # Not super().__init__: the dataset and iterator live on the workers.
        replicate_lib._validate(step_fn, input_fn, reduce, steps_per_call)
        self.strategy = strategy
        self.reduce = reduce
        self.steps_per_call = steps_per_call
        self._step_fn = step_fn
        if isinstance(input_fn, dataset_sharder.ShardedInput):
            input_fn = worker_shards.WorkerShardedInput.from_sharded_input(
                input_fn
            )
        if isinstance(input_fn, worker_shards.WorkerShardedInput):
            # Sharded over the workers, repeated (see `distribute`).
            examples, workers = input_fn, strategy.num_workers

            def dataset_fn(ctx):
                return examples.worker_dataset(ctx, workers)

        else:
            checked = replicate_lib._checked_input_fn(input_fn)

            def dataset_fn(ctx):
                return checked(ctx).repeat()

        self.dataset = strategy.coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(dataset_fn)
        )
        self._iterator = iter(self.dataset)
        # Outputs' structure, True at None leaves (None if none); set by
        # tracing `_run`.
        self._none_leaves = None
        self._function = tf.function(self._run)

    def __call__(self):
        """Schedules `steps_per_call` steps on a free worker.

        Returns:
            A `RemoteValue`; `fetch()` returns the last step's outputs,
            None leaves included.
        """
        # `schedule` traces first, so `_none_leaves` is current.
        remote = self.strategy.coordinator.schedule(
            self._function, args=(self._iterator,)
        )
        if self._none_leaves is None:
            return remote
        return _RemoteValueWithNones(remote, self._none_leaves)

    def _run(self, iterator):
        outputs = super()._run(iterator)
        flat = tf.nest.flatten(outputs)
        if outputs is None or all(v is not None for v in flat):
            self._none_leaves = None
            return outputs
        # Fetching a None from a RemoteValue fails ("Attempt to convert a
        # value (None) with an unsupported type"): send only the tensors;
        # `_RemoteValueWithNones` restores the Nones.
        self._none_leaves = tf.nest.map_structure(lambda v: v is None, outputs)
        return [v for v in flat if v is not None]


class _RemoteValueWithNones(tf.distribute.experimental.coordinator.RemoteValue):
    """A step's `RemoteValue`, with the None leaves the worker did not send.

    `remote` holds the flat list of tensors; `none_leaves` is the outputs'
    structure, True at None leaves.
    """

    def __init__(self, remote, none_leaves):
        self._remote = remote
        self._none_leaves = none_leaves

    def fetch(self):
        """Waits for the step; returns its outputs as NumPy values."""
        return self._restore(self._remote.fetch())

    def get(self):
        """Waits for the step; returns its outputs as tensors."""
        return self._restore(self._remote.get())

    def _restore(self, values):
        values = iter(values)
        flat = [
            None if is_none else next(values)
            for is_none in tf.nest.flatten(self._none_leaves)
        ]
        return tf.nest.pack_sequence_as(self._none_leaves, flat)


def check_async_cluster(config: cluster_lib.ClusterConfig) -> None:
    """Raises ValueError unless a `ClusterConfig` has chief, worker and ps."""
    jobs = {job: list(a) for job, a in config.cluster.items()}
    needs = (
        ("ps", "a 'ps' job (parameter servers hold the variables)"),
        ("worker", "a 'worker' job (workers run the steps)"),
        ("chief", "a 'chief' job (the coordinator that runs your program)"),
    )
    for job, why in needs:
        if not config.cluster.get(job):
            raise ValueError(
                f"AsyncReplicator needs {why}; this cluster has none. Start "
                "one with `keras-replicator launch --workers N --ps M`, or "
                f"add it to TF_CONFIG. Received: cluster={jobs}"
            )


def _partitioner(value: Any, config: cluster_lib.ClusterConfig):
    if value is None or isinstance(
        value, tf.distribute.experimental.partitioners.Partitioner
    ):
        return value
    if not validation.is_int(value):
        raise TypeError(
            "`variable_partitioner` must be None, a tf.distribute."
            "experimental.partitioners.Partitioner or an integer "
            f"min_shard_bytes. Received: variable_partitioner={value!r} "
            f"(of type {type(value).__name__})"
        )
    if value < 1:
        raise ValueError(
            "`variable_partitioner` as min_shard_bytes must be at least 1. "
            f"Received: variable_partitioner={value}"
        )
    return tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=value, max_shards=len(config.cluster["ps"])
    )


def serve(config: cluster_lib.ClusterConfig | None = None) -> None:
    """Runs this worker or ps task's TF server (`config` or TF_CONFIG) forever.

    Raises ValueError for a task that is not `"worker"` or `"ps"`.
    """
    if config is None:
        config = cluster_lib.parse_tf_config(os.environ.get("TF_CONFIG", ""))
    if config.task_type not in _SERVER_JOBS:
        raise ValueError(
            f"Only {_SERVER_JOBS} tasks serve; the chief runs the program. "
            f"Received: task.type={config.task_type!r}"
        )
    server_config = tf.compat.v1.ConfigProto()
    server_config.inter_op_parallelism_threads = max(
        _MIN_INTER_OP_THREADS, os.cpu_count() or 1
    )
    server = tf.distribute.Server(
        tf.train.ClusterSpec(config.to_dict()["cluster"]),
        job_name=config.task_type,
        task_index=config.task_index,
        protocol="grpc",
        config=server_config,
        start=True,
    )
    server.join()
