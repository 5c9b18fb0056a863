"""The base every replicator shares: chief, batch helpers, research API.

Each backend is a `tf.distribute.Strategy` subclass with `ReplicatorMixin` first
in its bases, so every backend gets the same `is_chief`, global-batch helpers,
`replicate`, `wrap_optimizer` and `distribute`.
"""

from __future__ import annotations

import itertools
import threading

import tensorflow as tf

from keras_replicator._src import patches
from keras_replicator._src.core import replica_step
from keras_replicator._src.core import traits
from keras_replicator._src.core import validation
from keras_replicator._src.data import dataset_sharder
from keras_replicator._src.patches import iterator_teardown
from keras_replicator._src.training import hang_watchdog
from keras_replicator._src.training import optimizer as optimizer_lib
from keras_replicator._src.training import replicate as replicate_lib

# Group keys of collective ops are process-global in TensorFlow's runtime, but
# each tf.distribute strategy numbers its groups from 1. Two strategies in one
# process with different device sets then share group key 1 and the runtime
# fails with "joining a group with size 4, but that group has size 2 ... Restart
# your program" (tensorflow/tensorflow#62790). Every replicator takes its own
# block of keys instead. Multi-worker replicators count their blocks apart,
# from a range of their own: workers that create as many of them agree on the
# keys, whatever local replicators each created.
_KEY_BLOCK = 10_000
_MULTI_WORKER_KEYS = 1_000_000_000  # group keys are int32
_key_blocks = itertools.count(1)
_multi_worker_blocks = itertools.count(0)
_key_lock = threading.Lock()


def next_collective_key_base(multi_worker: bool = False) -> int:
    """Returns a collective group-key base no other replicator here uses."""
    with _key_lock:
        if multi_worker:
            return _MULTI_WORKER_KEYS + next(_multi_worker_blocks) * _KEY_BLOCK
        return next(_key_blocks) * _KEY_BLOCK


class ReplicatorMixin:
    """What every replicator backend has, whatever its topology.

    Put it first in the bases of a `tf.distribute.Strategy` subclass, set
    `replicator_kind` (one of `core.traits.KINDS`) and call
    `_install_patches()` in `__init__` before the strategy is built.
    Subclasses that span processes override `is_chief`, `num_workers` and
    `worker_index`.
    """

    # Which backend this is; patches dispatch on it (core.traits).
    replicator_kind: str = ""

    def _install_patches(self) -> None:
        """Installs the Keras/TF patches this kind of replicator declares.

        Each patch lists the kinds it applies to (`patches/registry.py`);
        installing is idempotent, and every patched method falls back to
        stock Keras for models under other strategies.
        """
        patches.install_for(self.replicator_kind)

    # Not converted by AutoGraph when called inside a tf.function: the
    # wrapper converts `fn` itself, as `Strategy.run` does.
    @tf.autograph.experimental.do_not_convert
    def run(self, fn, args=(), kwargs=None, options=None):
        """Runs `fn` on every replica; see `tf.distribute.Strategy.run`.

        Under in-graph replicators each replica notes which API runs it and
        how many examples its batch holds (`core/replica_step.py`): an
        optimizer in the user's own `run` keeps tf.distribute's gradient
        convention (shares, summed), one in a Keras step or `replicate`
        averages, weighing the replicas as one device weighs the examples.
        See `gradient_reduction`.
        """
        if traits.is_in_graph(self):
            fn = replica_step.recording(fn)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def experimental_distribute_dataset(self, dataset, options=None):
        """Distributes `dataset`; see `tf.distribute.Strategy`.

        Under in-graph replicators the dataset runs without tf.data's
        autotune thread (unless the user set an autotune option), so that
        deleting its iterator cannot stall (`patches/iterator_teardown.py`).
        """
        if traits.is_in_graph(self):
            dataset = iterator_teardown.without_autotune_thread(dataset)
        return super().experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Distributes `dataset_fn`'s datasets; see `tf.distribute.Strategy`.

        Like `experimental_distribute_dataset`, without tf.data's autotune
        thread under in-graph replicators.
        """
        if traits.is_in_graph(self):
            dataset_fn = iterator_teardown.without_autotune_thread_fn(
                dataset_fn
            )
        return super().distribute_datasets_from_function(dataset_fn, options)

    def _set_gradient_reduction(self, gradient_reduction: str) -> None:
        """Validates and keeps the `gradient_reduction` argument."""
        if gradient_reduction not in replica_step.GRADIENT_REDUCTIONS:
            raise ValueError(
                "`gradient_reduction` must be one of "
                f"{replica_step.GRADIENT_REDUCTIONS}. Received: "
                f"gradient_reduction={gradient_reduction!r}"
            )
        self._gradient_reduction = gradient_reduction

    @property
    def gradient_reduction(self) -> str:
        """How optimizers combine the replicas' gradients.

        `"auto"` (the default) follows the API that runs the update: in
        Keras' `fit`/`evaluate` (any `train_step`) and in `replicate` or
        with `wrap_optimizer`, a loss is the replica's own mean and the
        gradients are averaged (one device's numbers); in your own
        `strategy.run` with a plain optimizer, tf.distribute's convention
        holds (each replica's loss is its share, the gradients are summed,
        as under stock `MirroredStrategy`). `tf.nn.compute_average_loss`
        and `tf.nn.scale_regularization_loss` mean "my share" everywhere.
        `"mean"` averages in every update, `"sum"` keeps stock
        tf.distribute behaviour in every update (Keras divides its losses
        by the replica count and sums).
        """
        return getattr(self, "_gradient_reduction", "auto")

    def _set_shard_optimizer_state(self, shard_optimizer_state: bool) -> None:
        """Validates and keeps the `shard_optimizer_state` argument."""
        if not isinstance(shard_optimizer_state, bool):
            raise TypeError(
                "`shard_optimizer_state` must be True or False. Received: "
                f"shard_optimizer_state={shard_optimizer_state!r}"
            )
        self._shard_optimizer_state = shard_optimizer_state

    @property
    def shard_optimizer_state(self) -> bool:
        """Whether optimizers keep 1/N of their per-weight state per replica.

        ZeRO stage 1, opt-in; checkpoints still hold the full state. See
        `sharding/optimizer_shards.py` and the Speed page of the docs.
        """
        return getattr(self, "_shard_optimizer_state", False)

    def _set_sync_batch_norm(self, sync_batch_norm: bool) -> None:
        """Validates and keeps the `sync_batch_norm` argument."""
        if not isinstance(sync_batch_norm, bool):
            raise TypeError(
                "`sync_batch_norm` must be True or False. Received: "
                f"sync_batch_norm={sync_batch_norm!r}"
            )
        self._sync_batch_norm = sync_batch_norm

    @property
    def sync_batch_norm(self) -> bool:
        """Whether `BatchNormalization` normalizes over the global batch.

        True (the default): in Keras' `fit`, `evaluate`, `train_on_batch`
        and `test_on_batch` (any `train_step`), and in `replicate` steps,
        every `keras.layers.BatchNormalization` computes its training
        statistics over the global batch of every replica (one all-reduce
        per layer and step), so the weights and logs are one device's, as
        under `keras.distribution` and Keras on JAX. Your own
        `strategy.run` keeps tf.distribute's per-replica statistics, as
        the gradient convention does (`gradient_reduction`). False keeps
        per-replica statistics everywhere, where speed matters more than
        one device's numbers (docs/exact.md has the cost).
        """
        return getattr(self, "_sync_batch_norm", True)

    def _set_hang_seconds(self, hang_seconds: float | None) -> None:
        """Validates and keeps the `hang_seconds` argument."""
        hang_watchdog.check_setting("hang_seconds", hang_seconds)
        self._hang_seconds = hang_seconds

    @property
    def hang_seconds(self) -> float | None:
        """The hang watchdog's timeout as given (None: from the environment).

        None reads `KERAS_REPLICATOR_HANG_SECONDS` when a loop starts
        (default 600 s); 0 turns the watchdog off. See
        `training/hang_watchdog.py`.
        """
        return getattr(self, "_hang_seconds", None)

    @property
    def is_chief(self) -> bool:
        """True on exactly one process: the one that writes files and logs."""
        return True

    @property
    def num_workers(self) -> int:
        """The number of worker processes that hold replicas."""
        return 1

    @property
    def worker_index(self) -> int:
        """This process's index among the workers, from 0."""
        return 0

    @property
    def replicas_per_worker(self) -> int:
        """The number of replicas this process holds."""
        return self.num_replicas_in_sync // self.num_workers

    def per_replica_batch_size(self, global_batch_size: int) -> int:
        """Splits a global batch size evenly over all replicas.

        Args:
            global_batch_size: The batch size of one step over all replicas
                and workers.

        Returns:
            `global_batch_size // num_replicas_in_sync`.

        Raises:
            ValueError: If `global_batch_size` is not a positive integer or is
                not divisible by the number of replicas.
        """
        _check_positive_int("global_batch_size", global_batch_size)
        replicas = self.num_replicas_in_sync
        if global_batch_size % replicas:
            raise ValueError(
                f"The global batch size must be divisible by the number of "
                f"replicas ({replicas}). Received: "
                f"global_batch_size={global_batch_size}, "
                f"num_replicas_in_sync={replicas}"
            )
        return global_batch_size // replicas

    def global_batch_size(self, per_replica_batch_size: int) -> int:
        """The global batch size for a per-replica batch size.

        Args:
            per_replica_batch_size: Examples each replica takes per step.

        Returns:
            `per_replica_batch_size * num_replicas_in_sync`.

        Raises:
            ValueError: If `per_replica_batch_size` is not a positive integer.
        """
        _check_positive_int("per_replica_batch_size", per_replica_batch_size)
        return per_replica_batch_size * self.num_replicas_in_sync

    def distribute(self, dataset_or_input_fn, global_batch_size, **options):
        """Shards, shuffles and batches unbatched examples for this replicator.

        See `keras_replicator.data.shard` for the arguments and semantics.

        Args:
            dataset_or_input_fn: A `tf.data.Dataset` of single examples, or a
                function of a `tf.distribute.InputContext` returning one.
            global_batch_size: Examples per step over all replicas.
            **options: `shuffle_seed=None`, `static_shapes=None` (True on
                TPU), `mode="train"` or `"eval"`, `shuffle_buffer_size`.

        Returns:
            A distributed dataset for `model.fit`, `model.evaluate` and
            custom loops; in eval mode every example counts exactly once.
        """
        return dataset_sharder.distribute(
            self, dataset_or_input_fn, global_batch_size, **options
        )

    def replicate(self, step_fn, input_fn, reduce="mean", steps_per_call=1):
        """Compiles one replica's step to run on every replica in sync.

        The TF-Replicator research API: write one replica, as on one device.
        `input_fn(ctx)` gets a `tf.distribute.InputContext` and returns a
        `tf.data.Dataset` of PER-REPLICA batches (shard it with
        `ctx.input_pipeline_id` / `ctx.num_input_pipelines` and batch it with
        `ctx.get_per_replica_batch_size(global_batch)`). `step_fn(batch)`
        runs on each replica; inside it, use the cross-replica primitives
        (`kr.all_reduce`, `kr.all_gather`, ...) and a `wrap_optimizer`
        optimizer. Create variables under `replicator.scope()` beforehand.

        Example:
        ```python
        step = replicator.replicate(step_fn, input_fn)
        for _ in range(1000):
            loss = step()  # mean over every replica of every worker
        ```

        Args:
            step_fn: One replica's step: called with that replica's batch,
                returns a tensor, a nest of tensors, or None.
            input_fn: Called once per input pipeline (one per worker) with a
                `tf.distribute.InputContext`; returns a `tf.data.Dataset`.
            reduce: How outputs combine: `"mean"` or `"sum"` over all
                replicas and workers, or None for a list with one output per
                LOCAL replica, in replica order. Defaults to `"mean"`. A
                mean is a true division, as `tf.distribute`'s: integer
                outputs come back as floats; None leaves stay None.
            steps_per_call: Steps each call runs in one `tf.function` call
                (outputs are the last step's). Defaults to 1.

        Returns:
            A callable; each call advances every replica and returns the
            outputs.

        Raises:
            TypeError: If `step_fn` or `input_fn` is not callable, or
                `input_fn` does not return a `tf.data.Dataset`.
            ValueError: If `reduce` or `steps_per_call` is not supported.
        """
        return replicate_lib.replicate(
            self, step_fn, input_fn, reduce, steps_per_call
        )

    def wrap_optimizer(
        self, optimizer, accumulation_steps=1, compression=None, **options
    ):
        """Wraps a Keras optimizer to average gradients over every replica.

        In `step_fn` compute a plain per-replica mean loss (no division by
        the replica count) and call `optimizer.apply_gradients(...)` as on
        one device: gradients are averaged over all replicas and workers
        once, in a few packed all-reduces, then applied. Under `model.fit`
        it trains exactly like the unwrapped optimizer (see
        `ReplicatedOptimizer`).

        Args:
            optimizer: A `keras.optimizers.Optimizer` created under
                `replicator.scope()`. Use only the returned wrapper after.
            accumulation_steps: Micro-batches accumulated locally before one
                all-reduce and update. Defaults to 1.
            compression: None, `"bf16"` or `"fp16"`: the dtype gradients
                travel in during the all-reduce. Defaults to None.
            **options: `bytes_per_pack`, the target size of one packed
                all-reduce (default 32 MiB; 0 packs everything into one).

        Returns:
            A `ReplicatedOptimizer`, itself a `keras.optimizers.Optimizer`.

        Raises:
            TypeError: If `optimizer` is not a Keras optimizer.
            ValueError: If an option is out of range, or `optimizer` was
                created outside `replicator.scope()`.
        """
        return optimizer_lib.wrap_optimizer(
            self, optimizer, accumulation_steps, compression, **options
        )

    def __repr__(self) -> str:
        devices = getattr(self.extended, "worker_devices", ())
        return (
            f"{type(self).__name__}(num_replicas_in_sync="
            f"{self.num_replicas_in_sync}, devices={list(devices)})"
        )


_check_positive_int = validation.check_positive_int
