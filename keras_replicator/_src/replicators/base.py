"""The base every replicator shares: chief, batch helpers, research API.

Each backend is a `tf.distribute.Strategy` with `ReplicatorMixin` first in
its bases.
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

# Collective group keys are process-global in TF's runtime, but each strategy
# numbers its groups from 1: two strategies with different device sets share
# key 1 and fail with "joining a group with size 4, but that group has size 2
# ... Restart your program" (tensorflow/tensorflow#62790). So each replicator
# takes its own key block; multi-worker ones count from a range of their own,
# so workers creating as many agree on keys whatever local ones they made.
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

    Put it first in a `tf.distribute.Strategy` subclass's bases, set
    `replicator_kind` (one of `core.traits.KINDS`) and call
    `_install_patches()` in `__init__` before the strategy is built.
    Multi-process subclasses override `is_chief`, `num_workers`, `worker_index`.
    """

    # Which backend this is; patches dispatch on it (core.traits).
    replicator_kind: str = ""

    def _install_patches(self) -> None:
        """Installs the Keras/TF patches this kind of replicator declares.

        Idempotent (`patches/registry.py`); patched methods fall back to stock
        Keras under other strategies.
        """
        patches.install_for(self.replicator_kind)

    # Not AutoGraph-converted: the wrapper converts `fn`, as `Strategy.run`.
    @tf.autograph.experimental.do_not_convert
    def run(self, fn, args=(), kwargs=None, options=None):
        """Runs `fn` on every replica; see `tf.distribute.Strategy.run`.

        In-graph replicators record which API runs each replica and its batch
        size (`core/replica_step.py`), for `gradient_reduction`.
        """
        if traits.is_in_graph(self):
            fn = replica_step.recording(fn)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def experimental_distribute_dataset(self, dataset, options=None):
        """Distributes `dataset`; see `tf.distribute.Strategy`.

        In-graph replicators drop tf.data's autotune thread (unless the user
        set an autotune option) so deleting the iterator cannot stall
        (`patches/iterator_teardown.py`).
        """
        if traits.is_in_graph(self):
            dataset = iterator_teardown.without_autotune_thread(dataset)
        return super().experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Distributes `dataset_fn`'s datasets; see `tf.distribute.Strategy`.

        Drops the autotune thread as `experimental_distribute_dataset` does.
        """
        if traits.is_in_graph(self):
            dataset_fn = iterator_teardown.without_autotune_thread_fn(
                dataset_fn
            )
        return super().distribute_datasets_from_function(dataset_fn, options)

    def _set_options(
        self,
        gradient_reduction: str,
        sync_batch_norm: bool,
        hang_seconds: float | None,
        shard_optimizer_state: bool,
    ) -> None:
        """Validates and keeps the arguments every replicator takes."""
        if gradient_reduction not in replica_step.GRADIENT_REDUCTIONS:
            raise ValueError(
                "`gradient_reduction` must be one of "
                f"{replica_step.GRADIENT_REDUCTIONS}. Received: "
                f"gradient_reduction={gradient_reduction!r}"
            )
        flags = {
            "sync_batch_norm": sync_batch_norm,
            "shard_optimizer_state": shard_optimizer_state,
        }
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(
                    f"`{name}` must be True or False. Received: "
                    f"{name}={value!r}"
                )
        hang_watchdog.check_setting("hang_seconds", hang_seconds)
        self._gradient_reduction = gradient_reduction
        self._sync_batch_norm = sync_batch_norm
        self._hang_seconds = hang_seconds
        self._shard_optimizer_state = shard_optimizer_state

    @property
    def gradient_reduction(self) -> str:
        """How optimizers combine the replicas' gradients.

        `"auto"` (default): in Keras' `fit`/`evaluate` (any `train_step`),
        `replicate` or `wrap_optimizer`, each loss is the replica's mean and
        gradients are averaged (one device's numbers); in your own
        `strategy.run` with a plain optimizer, each loss is its share and
        gradients are summed, as under stock `MirroredStrategy`.
        `tf.nn.compute_average_loss` and `tf.nn.scale_regularization_loss`
        mean "my share" everywhere. `"mean"` always averages; `"sum"` always
        keeps stock tf.distribute (Keras divides losses by replicas and sums).
        """
        return getattr(self, "_gradient_reduction", "auto")

    @property
    def shard_optimizer_state(self) -> bool:
        """Whether optimizers keep 1/N of their per-weight state per replica.

        ZeRO stage 1, opt-in; checkpoints hold the full state. See
        `sharding/optimizer_shards.py` and the docs' Speed page.
        """
        return getattr(self, "_shard_optimizer_state", False)

    @property
    def sync_batch_norm(self) -> bool:
        """Whether `BatchNormalization` normalizes over the global batch.

        True (default): in Keras' `fit`, `evaluate`, `train_on_batch`,
        `test_on_batch` (any `train_step`) and `replicate` steps, every
        `keras.layers.BatchNormalization` takes training statistics over all
        replicas (one all-reduce per layer and step): one device's numbers, as
        under `keras.distribution` and Keras on JAX. Your own `strategy.run`
        keeps per-replica statistics, like `gradient_reduction`. False keeps
        them everywhere, for speed (docs/exact.md has the cost).
        """
        return getattr(self, "_sync_batch_norm", True)

    @property
    def hang_seconds(self) -> float | None:
        """The hang watchdog's timeout as given (None: from the environment).

        None reads `KERAS_REPLICATOR_HANG_SECONDS` when a loop starts (default
        600 s); 0 turns it off. See `training/hang_watchdog.py`.
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
            global_batch_size: One step's batch size over all replicas.

        Returns:
            `global_batch_size // num_replicas_in_sync`.

        Raises:
            ValueError: If `global_batch_size` is not a positive integer
                divisible by the number of replicas.
        """
        validation.check_positive_int("global_batch_size", global_batch_size)
        replicas = self.num_replicas_in_sync
        dataset_sharder.check_divisible(global_batch_size, replicas)
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
        validation.check_positive_int(
            "per_replica_batch_size", per_replica_batch_size
        )
        return per_replica_batch_size * self.num_replicas_in_sync

    def distribute(self, dataset_or_input_fn, global_batch_size, **options):
        """Shards, shuffles and batches unbatched examples for this replicator.

        Semantics as `keras_replicator.data.shard`.

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

        The TF-Replicator research API. `input_fn(ctx)` returns a dataset of
        PER-REPLICA batches (shard by `ctx.input_pipeline_id` /
        `ctx.num_input_pipelines`, batch by
        `ctx.get_per_replica_batch_size(global_batch)`). In `step_fn` use
        `kr.all_reduce`, `kr.all_gather`, ... and a `wrap_optimizer`
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
            reduce: `"mean"` or `"sum"` over all replicas and workers, or
                None for a list of one output per LOCAL replica, in order.
                Defaults to `"mean"`. The mean is a true division, as in
                `tf.distribute`: integers come back as floats; None stays.
            steps_per_call: Steps each call runs in one `tf.function` call
                (outputs are the last step's). Defaults to 1.

        Returns:
            A callable advancing every replica and returning the outputs.

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

        In `step_fn` compute a per-replica mean loss and call
        `optimizer.apply_gradients(...)` as on one device: gradients are
        averaged over all replicas in a few packed all-reduces. Under
        `model.fit` it trains like the unwrapped optimizer.

        Args:
            optimizer: A `keras.optimizers.Optimizer` created under
                `replicator.scope()`; use only the wrapper afterwards.
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
