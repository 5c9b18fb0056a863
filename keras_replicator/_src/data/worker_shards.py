"""Examples sharded over the workers of an AsyncReplicator.

`AsyncReplicator.distribute(examples, global_batch_size)` (and
`kr.data.shard(...)` given to `fit` under it) follow TensorFlow's
parameter-server convention: each step runs on ONE worker and takes
`global_batch_size` examples, split over its replicas (GPUs). Worker `i` of
`W` reads every `W`-th example from the `i`-th and repeats its shard
forever; the coordinator decides an epoch's steps: `N // global_batch_size`
for `N` known examples, as in one synchronous epoch.

The workers' dataset function cannot capture a coordinator's dataset
("Unable to parse tensor proto"), so it is serialized to a graph once and
rebuilt on every worker (as `ClusterCoordinator.create_per_worker_dataset`
does for a whole dataset).
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from keras_replicator._src.core import validation

# Private, but what `create_per_worker_dataset` uses; no public equivalent.
from keras_replicator._src.upstream import ps_values as _ps_values

_MODES = ("train", "eval")


class WorkerShardedInput:
    """Unbatched examples for an AsyncReplicator's `fit`/`evaluate`.

    Made by `AsyncReplicator.distribute`, or by `from_sharded_input` from
    a `kr.data.shard(...)` result, for `fit`, `evaluate` and `predict`; not
    iterable on the chief. `source` is a dataset of single examples or a
    function of an `InputContext` (called on every worker with one
    pipeline; the result is sharded by element). `global_batch_size` is one
    step's examples on one worker; `shuffle_seed` reshuffles each shard
    every pass (None keeps the order); in eval `mode` elements become
    `(x, y, weight)`. `examples` is the count when the cardinality is known,
    and `steps_per_epoch` then `examples // global_batch_size` (rounded up
    in eval). Raises ValueError for a bad `mode` or size, TypeError for a
    `source` neither a dataset nor callable.
    """

    def __init__(
        self,
        source: Any,
        global_batch_size: int,
        *,
        shuffle_seed: int | None = None,
        mode: str = "train",
        shuffle_buffer_size: int = 10_000,
    ):
        if mode not in _MODES:
            raise ValueError(
                f"`mode` must be one of {_MODES}. Received: mode={mode!r}"
            )
        validation.check_positive_int("global_batch_size", global_batch_size)
        validation.check_positive_int(
            "shuffle_buffer_size", shuffle_buffer_size
        )
        if not isinstance(source, tf.data.Dataset) and not callable(source):
            raise TypeError(
                "`dataset_or_input_fn` must be a tf.data.Dataset or a "
                "function taking a tf.distribute.InputContext. Received: "
                f"dataset_or_input_fn={source!r}"
            )
        self._source = source
        self.global_batch_size = global_batch_size
        self.shuffle_seed = shuffle_seed
        self.mode = mode
        self._buffer = shuffle_buffer_size
        self._graph = self._spec = None
        self.examples = None
        if isinstance(source, tf.data.Dataset):
            self._graph = _ps_values.serialize_dataset_to_graph(source)
            self._spec = source.element_spec
            cardinality = int(source.cardinality())
            if cardinality >= 0:
                self.examples = cardinality
        self.steps_per_epoch = None
        if self.examples is not None:
            if mode == "train":
                self.steps_per_epoch = self.examples // global_batch_size
            else:
                self.steps_per_epoch = math.ceil(
                    self.examples / global_batch_size
                )

    def examples_dataset(
        self, ctx: tf.distribute.InputContext | None = None
    ) -> tf.data.Dataset:
        """All the examples, unbatched, in order (rebuilt from the graph).

        `ctx` (default: one pipeline, one replica) is for a source
        function; TypeError if that returns no dataset.
        """
        if self._graph is not None:
            return _ps_values.deserialize_dataset_from_graph(
                self._graph, self._spec
            )
        dataset = self._source(ctx or tf.distribute.InputContext())
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                "The input function must return a tf.data.Dataset of "
                f"unbatched examples. Received: {dataset!r}"
            )
        return dataset

    def worker_dataset(
        self, ctx: tf.distribute.InputContext, num_workers: int
    ) -> tf.data.Dataset:
        """This worker's shard as per-replica batches, repeated forever.

        Call it in `ClusterCoordinator.create_per_worker_dataset`'s dataset
        function on a worker, which reads its index there
        (`experimental_get_current_worker_index`). `ctx`'s replicas split
        each step's batch.
        """
        dataset = self.examples_dataset(
            tf.distribute.InputContext(
                num_replicas_in_sync=ctx.num_replicas_in_sync
            )
        )
        coordinator = tf.distribute.coordinator
        index = coordinator.experimental_get_current_worker_index()
        dataset = dataset.shard(num_workers, tf.cast(index, tf.int64))
        if self.mode == "eval":
            dataset = dataset.map(_with_weight)
        elif self.shuffle_seed is not None:
            dataset = dataset.shuffle(
                self._buffer,
                seed=self.shuffle_seed,
                reshuffle_each_iteration=True,
            )
        batch = ctx.get_per_replica_batch_size(self.global_batch_size)
        return dataset.repeat().batch(batch, drop_remainder=True)

    def local_dataset(self) -> tf.data.Dataset:
        """Every example once, in order, in batches, on the coordinator.

        For exact evaluation and prediction: no sharding or padding (one
        process, one pass); the last batch may be short.
        """
        dataset = self.examples_dataset()
        if self.mode == "eval":
            dataset = dataset.map(_with_weight)
        return dataset.batch(self.global_batch_size)

    @classmethod
    def from_sharded_input(cls, sharded: Any) -> WorkerShardedInput:
        """The same examples and options as `sharded`, a `ShardedInput`."""
        return cls(
            sharded.source,
            sharded.global_batch_size,
            shuffle_seed=sharded.shuffle_seed,
            mode=sharded.mode,
            shuffle_buffer_size=sharded.shuffle_buffer_size,
        )


def _with_weight(*example):
    """`(x, y)` to `(x, y, 1.0)`; `(x, y, w)` as it is."""
    if len(example) == 3:
        return example
    if len(example) != 2:
        raise TypeError(
            "In eval mode every example must be a tuple (x, y) or "
            f"(x, y, sample_weight). Received: {len(example)} components"
        )
    return (*example, tf.constant(1.0))
