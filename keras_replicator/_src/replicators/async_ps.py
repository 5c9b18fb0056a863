"""AsyncReplicator: asynchronous training with parameter servers.

The paper's `MultiWorkerAsyncReplicator`. Variables live on parameter-server
tasks ("ps"); the chief process is the coordinator: it runs the user's
program and dispatches steps (closures) to worker tasks, each of which reads
the current variables, computes one step and applies its update without
waiting for the others. A `tf.distribute.ParameterServerStrategy` with a
`ClusterCoordinator` does the work; this module adds what Keras 3 lacks
(`model.fit`/`evaluate`, see `async_training`) and the research API.

Workers and parameter servers run only a TensorFlow server: `serve()` (the
`SERVE_COMMAND` below, which `keras-replicator launch --ps` uses), or the
user's own script, whose `AsyncReplicator()` call serves and never returns.
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

# What a worker or ps process runs: a bare TensorFlow server for TF_CONFIG
# (`serve` below; the launcher starts it by name).
SERVE_COMMAND = launch.SERVE_COMMAND
# Tasks that only serve; the chief (coordinator) runs the user's program.
_SERVER_JOBS = ("worker", "ps")
# A server executes the functions of the coordinator with its inter-op
# threads; with fewer than this (a 2-core machine) a step that waits on a
# parameter-server read can starve the thread pool and stall.
_MIN_INTER_OP_THREADS = 4


class AsyncReplicator(
    base.ReplicatorMixin, tf.distribute.ParameterServerStrategy
):
    """Trains asynchronously: workers update variables on parameter servers.

    The cluster has one `"chief"` (the coordinator, which runs your program),
    one or more `"worker"` tasks and one or more `"ps"` tasks. Create the
    model under `replicator.scope()`: its variables are placed on the
    parameter servers, round-robin, or sharded by `variable_partitioner`.
    `model.fit` then dispatches each step to whichever worker is free; the
    workers do not wait for each other, so a slow or dead worker does not
    stop training (its steps are rescheduled on the others).

    `replicator.distribute(examples, global_batch_size)` works as under
    every replicator, with TensorFlow's parameter-server convention: each
    step runs on one worker and takes `global_batch_size` examples, and the
    examples are sharded across the workers (see `distribute`); `model.fit`
    of it needs no `steps_per_epoch` when the number of examples is known.
    `x` may also be a `tf.data.Dataset` of batches, an `input_fn(ctx)`
    returning one, or NumPy arrays with `batch_size` (then pass
    `steps_per_epoch`); each worker builds its own copy and iterates it
    forever (shuffle it without a fixed seed so workers see different
    orders). `batch_size` is the batch of one step on one worker.

    On a `"worker"` or `"ps"` task the constructor starts the TensorFlow
    server and blocks forever, so the same script can run on every task.

    TensorFlow's gRPC cluster traffic is unauthenticated: keep the cluster on
    a trusted network.

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
            `tf.distribute.cluster_resolver.ClusterResolver`. It must have a
            `"chief"`, at least one `"worker"` and at least one `"ps"` task.
        variable_partitioner: None (each variable lives whole on one
            parameter server, round-robin), a
            `tf.distribute.experimental.partitioners.Partitioner`, or an
            integer `min_shard_bytes`: shard variables along their first axis
            into pieces of at least that many bytes, over at most all
            parameter servers (for large embeddings). Defaults to None.

    Raises:
        ValueError: If the cluster is missing or malformed, has no `"ps"`,
            `"worker"` or `"chief"` task, or `variable_partitioner` is an
            integer below 1.
        TypeError: If `cluster` or `variable_partitioner` has an
            unsupported type.
    """

    replicator_kind = "async"
    # Keras' fit/evaluate/predict of this replicator's models run these
    # loops (patches/trainer_loops.py dispatches to them).
    keras_loops = async_training

    def __init__(
        self,
        cluster: Any = None,
        variable_partitioner: Any = None,
    ):
        resolver, config = cluster_lib.resolve(cluster)
        check_async_cluster(config)
        partitioner = _partitioner(variable_partitioner, config)
        if config.task_type in _SERVER_JOBS:
            # The same script runs on every task; here it only serves.
            serve(config)
            sys.exit(0)  # pragma: no cover - serve() never returns
        self._config = config
        super().__init__(resolver, variable_partitioner=partitioner)
        # Creating the coordinator starts one thread per worker that pulls
        # scheduled steps off a shared queue.
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

        As `ReplicatorMixin.replicate`, but a call does not wait: it
        schedules the step on whichever worker is free and returns a
        `tf.distribute.experimental.coordinator.RemoteValue` at once. Its
        `fetch()` blocks until that step ran and returns the outputs,
        reduced over the local replicas of the worker that ran it (a step
        spans one worker). `replicator.join()` waits for every step.

        `input_fn(ctx)` is traced once and built on every worker;
        `ctx.input_pipeline_id` is 0 on all of them, so do not shard by it:
        shuffle without a fixed seed instead. The dataset is repeated: steps
        go to whichever worker is free, so no worker's copy may run out.

        Args:
            step_fn: One replica's step, called with that replica's batch.
            input_fn: Called with a `tf.distribute.InputContext`; returns a
                `tf.data.Dataset` of per-replica batches.
            reduce: `"mean"`, `"sum"` or None (a list, one output per
                replica of the worker). Defaults to `"mean"`.
            steps_per_call: Steps each call runs, in one closure. Defaults
                to 1.

        Returns:
            A callable; each call returns a `RemoteValue`.

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

        The same call as under every other replicator, with TensorFlow's
        parameter-server meaning of the batch: each step runs on one worker
        and takes `global_batch_size` examples (split over that worker's
        replicas, its GPUs; 1 replica on CPU). The examples are sharded by
        element across the workers (worker `i` of `W` reads examples `i`,
        `i + W`, ...), each worker shuffles its shard with `shuffle_seed`
        (a new order each pass) and repeats it forever.

        When the number of examples `N` is known (a dataset of known
        cardinality), `model.fit` needs no `steps_per_epoch`: an epoch is
        `N // global_batch_size` steps, the updates (of as many examples) of
        one synchronous epoch. Otherwise pass `steps_per_epoch`.
        `model.evaluate` of an eval-mode result runs on the chief, over
        every example exactly once, in batches of `global_batch_size`
        (with `steps=`, it runs that many steps on the workers instead).

        Args:
            dataset_or_input_fn: A `tf.data.Dataset` of single, unbatched
                examples (made here: it is sent to the workers as a graph),
                or a function of a `tf.distribute.InputContext` returning
                one, called on every worker; its dataset is sharded too.
            global_batch_size: Examples of one step (on one worker).
            shuffle_seed: Shuffles each worker's shard with this seed.
                Defaults to None: the dataset's order.
            static_shapes: Accepted for scripts that run on every backend;
                training batches are always full here (the last partial
                batch of a pass wraps into the next pass) and evaluation
                runs on the chief, so it changes nothing. Defaults to None.
            mode: `"train"` or `"eval"` (elements become
                `(x, y, sample_weight)`). Defaults to `"train"`.
            shuffle_buffer_size: Shuffle buffer, in examples. Defaults to
                10,000.

        Returns:
            A `WorkerShardedInput` for `model.fit`, `evaluate` and
            `predict` under this replicator.

        Raises:
            ValueError: If `mode` or a size is out of range, or
                `global_batch_size` does not divide over one worker's
                replicas.
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
        # The outputs' structure, True at each None leaf; set when `_run`
        # is traced, and None if no leaf is None.
        self._none_leaves = None
        self._function = tf.function(self._run)

    def __call__(self):
        """Schedules `steps_per_call` steps on a free worker.

        Returns:
            A `RemoteValue`; `fetch()` returns the last step's outputs,
            None leaves included.
        """
        # `schedule` traces the function before it returns, so
        # `_none_leaves` is up to date here.
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
        # A RemoteValue cannot hold None: fetching one fails with "Attempt
        # to convert a value (None) with an unsupported type". Send the
        # tensors only; `_RemoteValueWithNones` puts the None leaves back.
        self._none_leaves = tf.nest.map_structure(lambda v: v is None, outputs)
        return [v for v in flat if v is not None]


class _RemoteValueWithNones(tf.distribute.experimental.coordinator.RemoteValue):
    """A step's `RemoteValue`, with the None leaves the worker did not send.

    Args:
        remote: The `RemoteValue` of the step's tensors, a flat list.
        none_leaves: The structure of the step's outputs, True at its None
            leaves and False at its tensors.
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
    """Checks that a cluster has the chief, worker and ps tasks PS needs.

    Args:
        config: A validated `ClusterConfig`.

    Raises:
        ValueError: If a job is missing, naming the cluster received.
    """
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
    """Runs this task's TensorFlow server (a worker or ps) until killed.

    Args:
        config: The cluster and this task. Defaults to `TF_CONFIG`.

    Raises:
        ValueError: If the task is not a `"worker"` or `"ps"` task.
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
