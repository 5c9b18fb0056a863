"""The input of `model.fit`/`evaluate` under an AsyncReplicator.

Steps pull batches from per-worker datasets
(`ClusterCoordinator.create_per_worker_dataset`) iterated forever: steps go
to any free worker, so `steps_per_epoch`, not the data, ends an epoch.
`Source` also gives a finite local dataset for exact evaluation and
prediction on the coordinator.
"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from keras_replicator._src.data import dataset_sharder
from keras_replicator._src.data import worker_shards

# Keras' default batch size for arrays.
_DEFAULT_BATCH_SIZE = 32


class Source:
    """What `fit`/`evaluate` received, ready for workers or the coordinator.

    `x` is a `tf.data.Dataset` of batches, an `input_fn(ctx)` returning one,
    or arrays (NumPy, or a list/dict of them); `y`, `sample_weight` and
    `batch_size` (one step's, default 32) go only with arrays, else
    ValueError, as for a missing `x` or a distributed dataset. `shuffle`
    shuffles arrays, differently on every worker.
    """

    def __init__(
        self, x, y=None, batch_size=None, sample_weight=None, shuffle=True
    ):
        if x is None:
            raise ValueError(
                "Under AsyncReplicator, pass `x`: a tf.data.Dataset of "
                "batches, an input_fn(ctx) returning one, or arrays. "
                "Received: x=None"
            )
        self.dataset = self.input_fn = self.arrays = self.examples = None
        if isinstance(x, dataset_sharder.ShardedInput):
            # `kr.data.shard(...)`, with the ps meaning of the batch.
            x = worker_shards.WorkerShardedInput.from_sharded_input(x)
        if isinstance(x, worker_shards.WorkerShardedInput):
            _check_none_with(
                y=y, batch_size=batch_size, sample_weight=sample_weight
            )
            self.examples = x
            self.batch_size = x.global_batch_size
            self.shuffle = shuffle
            return
        if isinstance(x, tf.distribute.DistributedDataset):
            # Otherwise taken for an array, failing deep in Keras.
            raise ValueError(
                "Under AsyncReplicator, pass `x` as a tf.data.Dataset of "
                "batches, an input_fn(ctx) returning one, or arrays, not a "
                "distributed dataset (every worker iterates its own copy). "
                f"Received: x={x!r}"
            )
        if isinstance(x, tf.data.Dataset) or callable(x):
            _check_none_with(
                y=y, batch_size=batch_size, sample_weight=sample_weight
            )
            if isinstance(x, tf.data.Dataset):
                self.dataset = x
            else:
                self.input_fn = x
        else:
            arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
            self.arrays = tf.nest.map_structure(np.asarray, arrays)
            if len(self.arrays) == 1:
                self.arrays = self.arrays[0]
        self.batch_size = batch_size or _DEFAULT_BATCH_SIZE
        self.shuffle = shuffle

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps of one pass over the examples, when known, else None."""
        if self.examples is not None:
            return self.examples.steps_per_epoch
        return None

    def element_spec(self):
        """The structure, shapes and dtypes of one batch."""
        if self.examples is not None:
            return self.examples.local_dataset().element_spec
        if self.dataset is not None:
            return self.dataset.element_spec
        if self.input_fn is not None:
            return self._call_input_fn(
                tf.distribute.InputContext()
            ).element_spec
        return tf.nest.map_structure(
            lambda a: tf.TensorSpec((None, *a.shape[1:]), a.dtype), self.arrays
        )

    def per_worker_dataset(self, replicator):
        """A dataset on every worker of `replicator`, repeated forever.

        Returns `ClusterCoordinator.create_per_worker_dataset`'s result, whose
        `iter()` the scheduled steps take.
        """
        coordinator = replicator.coordinator
        if self.examples is not None:
            examples, workers = self.examples, replicator.num_workers
            return coordinator.create_per_worker_dataset(
                lambda: replicator.distribute_datasets_from_function(
                    lambda ctx: examples.worker_dataset(ctx, workers)
                )
            )
        if self.input_fn is not None:

            def dataset_fn(ctx):
                # A worker running out fails its step; the coordinator counts.
                return self._call_input_fn(ctx).repeat()

            return coordinator.create_per_worker_dataset(
                lambda: replicator.distribute_datasets_from_function(dataset_fn)
            )
        if self.dataset is not None:
            dataset = self.dataset.repeat()
        else:
            dataset = tf.data.Dataset.from_tensor_slices(self.arrays)
            if self.shuffle:
                # No seed: each worker draws its own order.
                dataset = dataset.shuffle(len(tf.nest.flatten(self.arrays)[0]))
            dataset = dataset.repeat().batch(
                self.batch_size, drop_remainder=True
            )
        with warnings.catch_warnings():
            # Serializing warns that tf.data options travel in the graph: fine.
            warnings.filterwarnings(
                "ignore", "To make it possible to preserve tf.data options"
            )
            return coordinator.create_per_worker_dataset(
                replicator.experimental_distribute_dataset(dataset)
            )

    def local_dataset(self) -> tf.data.Dataset:
        """The finite data as batches on the coordinator, in order."""
        if self.examples is not None:
            return self.examples.local_dataset()
        if self.dataset is not None:
            return self.dataset
        if self.input_fn is not None:
            raise ValueError(
                "An input_fn's dataset is built on the workers; give `steps`."
                " Received: steps=None"
            )
        return tf.data.Dataset.from_tensor_slices(self.arrays).batch(
            self.batch_size
        )

    def _call_input_fn(self, ctx):
        dataset = self.input_fn(ctx)
        if not isinstance(dataset, tf.data.Dataset):
            name = getattr(self.input_fn, "__name__", repr(self.input_fn))
            raise TypeError(
                "`input_fn` must return a tf.data.Dataset of batches. "
                f"Received: {name}(ctx) returned {dataset!r}"
            )
        return dataset


def _check_none_with(**values):
    for name, value in values.items():
        if value is not None:
            raise ValueError(
                f"`{name}` must be None when `x` is a dataset, an input_fn "
                "or `replicator.distribute(...)`'s result; put it in the "
                f"dataset. Received: {name}={value!r}"
            )
