"""Deleting a distributed iterator without stalling: no tf.data autotune thread.

Under `MultiWorkerReplicator`, `model.fit` returned 3-60 s after its last
step in about half the runs, the other workers waiting that long in their
next collective; a plain `MultiWorkerMirroredStrategy` loop stalls the same
way deleting its iterator, once it ran about ten seconds (stalls ended
10.24, 20.48 or 40.96 s after it began).

The cause: a lost wake-up in TensorFlow 2.21's autotuned tf.data iterators.
`RootDataset`'s `Model::OptimizeLoop` thread sleeps between optimisations,
doubling from 10 ms. Deleting the iterator calls `StartCancel()`, then joins
it; a cancellation callback wakes the loop BEFORE the manager is marked
cancelled (`tsl::CancellationManager::StartCancelWithStatus`), so it sees
`IsCancelled()` false and sleeps out its period (gdb:
`RootDataset::Iterator::~Iterator` -> `~LogicalThreadWrapper` while
`OptimizeLoop` waits). A distributed iterator has an autotuned root for the
host pipeline and one per device; Keras deletes it at the end of every
`fit`/`evaluate`/`predict` and exhausted epoch. Busy cores make it likelier.

For datasets our in-graph replicators distribute:

- the host pipeline gets `tf.data.Options().autotune.enabled = False` unless
  the user set an `autotune` option (never overridden). `AUTOTUNE`
  parallelism then is tf.data's default (at most the cores), and
  `prefetch(AUTOTUNE)` buffers still grow (the legacy prefetch autotuner);
- `MultiDeviceIterator`'s per-device stage (a generator and `prefetch(1)`)
  follows the host's setting: a pinned, reversible patch of
  `multi_device_iterator_ops`, scoped by the dataset's options.

Measured (benchmarks/RESULTS.md, 2-core VM, TF 2.21), 2 workers deleting
an iterator after 100 steps of about 0.1 s: 18 of 18 deletions took
0.15-0.24 s; before, 11 of 18 took 7-62 s.
"""

from __future__ import annotations

import functools
import threading

import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops as mdi

from keras_replicator._src.patches import registry

_building = threading.local()
# The `tf.data.Options().autotune` fields whose setting is a user's choice.
_AUTOTUNE_OPTIONS = (
    "enabled",
    "cpu_budget",
    "ram_budget",
    "autotune_algorithm",
)


def _no_autotune() -> tf.data.Options:
    options = tf.data.Options()
    options.autotune.enabled = False
    return options


def without_autotune_thread(dataset):
    """`dataset` without tf.data's autotune thread, unless the user chose.

    Anything but a `tf.data.Dataset`, and one whose autotune options the
    user set (`enabled` either way, a budget or algorithm), is returned as
    it is.
    """
    if not isinstance(dataset, tf.data.Dataset):
        return dataset
    autotune = dataset.options().autotune
    if any(getattr(autotune, name) is not None for name in _AUTOTUNE_OPTIONS):
        return dataset
    return dataset.with_options(_no_autotune())


def without_autotune_thread_fn(dataset_fn):
    """Wraps a `distribute_datasets_from_function` input function likewise.

    The wrapper forwards attribute reads to `dataset_fn`: the sharder's input
    functions carry attributes (`padded_eval`) that evaluation reads back.
    """
    return _QuietInputFn(dataset_fn)


class _QuietInputFn:
    def __init__(self, dataset_fn):
        self._dataset_fn = dataset_fn
        functools.update_wrapper(self, dataset_fn, updated=())

    def __call__(self, input_context):
        return without_autotune_thread(self._dataset_fn(input_context))

    def __getattr__(self, name):
        # Only called for attributes this wrapper lacks. Not for dunders or
        # before __init__ ran (copy, pickle): that would recurse.
        if name.startswith("__") or name == "_dataset_fn":
            raise AttributeError(name)
        return getattr(self._dataset_fn, name)


def _owned_init(original, self, dataset=None, *args, **kwargs):
    quiet = dataset is not None and dataset.options().autotune.enabled is False
    previous = getattr(_building, "quiet", False)
    _building.quiet = quiet
    try:
        original(self, dataset, *args, **kwargs)
    finally:
        _building.quiet = previous


def _create_device_dataset(original, *args, **kwargs):
    ds = original(*args, **kwargs)
    if getattr(_building, "quiet", False):
        ds = ds.with_options(_no_autotune())
    return ds


PATCH = registry.register(
    registry.Patch(
        name="iterator_teardown",
        targets=(
            registry.Target(
                mdi, "_create_device_dataset", _create_device_dataset
            ),
            registry.Target(
                mdi.OwnedMultiDeviceIterator, "__init__", _owned_init
            ),
        ),
        applies_to=frozenset({"local", "multi_worker"}),
        # OwnedMultiDeviceIterator builds each device's stage through the
        # module-level `_create_device_dataset`, inside its `__init__`.
        pins=(
            registry.Pin(
                "tensorflow.python.data.ops.multi_device_iterator_ops",
                (
                    "def _create_device_dataset(prototype_ds, "
                    "incarnation_id, prefetch_buffer_size,",
                    "ds = _create_device_dataset(prototype_device_datasets[i],",
                ),
            ),
        ),
        delete_when=(
            "tsl::CancellationManager::StartCancelWithStatus marks the "
            "manager cancelled before it runs the callbacks (the lost "
            "wake-up of Model::OptimizeLoop described above)"
        ),
    )
)
