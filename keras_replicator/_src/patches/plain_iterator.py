"""CPU replicas read their batches in turns from one plain tf.data iterator.

A `MultiDeviceIterator` traces about 26 functions per Keras iterator for 4
replicas (two per `fit`: 0.3 s on 2 cores) to copy batches between CPUs of
one memory. Our CPU replicas get per-replica mode without fetching (`TURNS`)
and the host once per replica as input devices, which stock TF never builds.
For it alone, the patch takes one element per replica from one iterator:
element k goes to replica k mod N, as `MultiDeviceIterator` deals them. The
`get_next` ops share a handle, so `tf.function` keeps their order.
`prefetch(1)` keeps its one batch ahead. `options=` and GPUs keep TF's path.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import input_lib

from keras_replicator._src.patches import registry
from keras_replicator._src.upstream import input_util

TURNS = tf.distribute.InputOptions(
    experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
    experimental_fetch_to_device=False,
)


class PlainInputExtended:
    """Mixin of an extended strategy whose CPU replicas take turns."""

    def _experimental_distribute_dataset(self, dataset, options):
        if options is not None or not self._kr_all_cpu():
            return super()._experimental_distribute_dataset(dataset, options)
        return input_util.get_distributed_dataset(
            dataset.prefetch(1),
            self._kr_turns_workers(),
            self._container_strategy(),
            num_replicas_in_sync=self._num_replicas_in_sync,
            input_context=self._kr_input_context(),
            options=TURNS,
        )

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if options is not None or not self._kr_all_cpu():
            return super()._distribute_datasets_from_function(
                dataset_fn, options
            )
        context = self._kr_input_context() or tf.distribute.InputContext(
            num_replicas_in_sync=self._num_replicas_in_sync
        )
        # `wraps`, for `markers.input_fn_of`.
        prefetched = functools.wraps(dataset_fn)(
            lambda ctx: dataset_fn(ctx).prefetch(1)
        )
        return input_util.get_distributed_datasets_from_function(
            dataset_fn=prefetched,
            input_workers=self._kr_turns_workers(),
            input_contexts=[context],
            strategy=self._container_strategy(),
            options=TURNS,
        )

    def _kr_input_context(self):
        # A worker's share (CollectiveAllReduceExtended); None in one process.
        make = getattr(self, "_make_input_context", None)
        return make() if make else None

    def _kr_turns_workers(self):
        # Not the MultiDeviceIterator's input workers: a function traced on
        # one retraces for the other (its spec compares no options).
        host = device_util.get_host_for_device(self.worker_devices[0])
        return input_lib.InputWorkers(
            [(host, [host] * len(self.worker_devices))]
        )

    def _kr_all_cpu(self) -> bool:
        devices = map(tf.DeviceSpec.from_string, self.worker_devices)
        return all(d.device_type == "CPU" for d in devices)


def _get_next_as_list(original, self, name=None):
    if self._options != TURNS or len(self._devices) == 1:  # noqa: SLF001
        return original(self, name)
    with tf.device(self._worker):  # noqa: SLF001
        return [self._iterator.get_next() for _ in self._devices]  # noqa: SLF001


def _get_next_as_optional_list(original, self):
    if self._options != TURNS or len(self._devices) == 1:  # noqa: SLF001
        return original(self)
    with tf.device(self._worker):  # noqa: SLF001
        iterator = self._iterator  # noqa: SLF001
        return [iterator.get_next_as_optional() for _ in self._devices]  # noqa: SLF001


_BASE = input_lib._SingleWorkerDatasetIteratorBase  # noqa: SLF001
PATCH = registry.register(
    registry.Patch(
        name="plain_iterator",
        targets=(
            registry.Target(_BASE, "get_next_as_list", _get_next_as_list),
            registry.Target(
                _BASE, "get_next_as_optional_list", _get_next_as_optional_list
            ),
        ),
        applies_to=frozenset({"local", "multi_worker"}),
        # Per-replica mode without fetching: a plain iterator, one element.
        pins=(
            registry.Pin(
                "tensorflow.python.distribute.input_lib",
                (
                    "and options.experimental_fetch_to_device)):",
                    "self._iterator = iter(self._dataset)",
                    "return self._format_data_list_with_options("
                    "self._iterator.get_next())",
                ),
            ),
        ),
        delete_when=(
            "tf.distribute feeds CPU replicas without a MultiDeviceIterator"
        ),
    )
)
