"""Deleting a distributed iterator without stalling: no tf.data autotune thread.

The symptom: under `MultiWorkerReplicator`, `model.fit` returned 3-60 s after
its last step in about half the runs, and the other workers waited that long
in their next collective. A plain `tf.distribute.MultiWorkerMirroredStrategy`
custom loop stalls the same way when it deletes its iterator. It takes an
iterator that has run for about ten seconds: the stalls ended 10.24, 20.48 or
40.96 s after the iterator began.

The cause is a lost wake-up in TensorFlow 2.21, in any autotuned tf.data
iterator. A `RootDataset` iterator with autotuning runs `Model::OptimizeLoop`
on a thread that sleeps between optimisations, and the sleep doubles from
10 ms (hence the 10 ms x 2^k). Deleting the iterator calls `StartCancel()`
and then joins that thread. `StartCancel` runs the cancellation callbacks,
and one of them wakes the loop, BEFORE it marks the manager cancelled
(`tsl::CancellationManager::StartCancelWithStatus`). The woken loop
re-checks `IsCancelled()`, still sees false, and sleeps out the rest of its
period. A distributed iterator has one autotuned root for the host pipeline
and one per device (`MultiDeviceIterator`'s per-device prefetch). Seen in
gdb:
`RootDataset::Iterator::~Iterator` -> `~LogicalThreadWrapper`, while
`Model::OptimizeLoop` waits on its condition variable. Keras deletes its
iterator at the end of every `fit`, `evaluate` and `predict`, and at every
epoch whose dataset is exhausted. The race is likelier on busy cores, where
the woken thread runs before the deleting thread sets the flag.

What we do, for the datasets our in-graph replicators (`LocalReplicator`,
`MultiWorkerReplicator`) distribute:

- The host pipeline runs with `tf.data.Options().autotune.enabled = False`
  unless the user set any of its `autotune` options. Without the autotune
  model, `num_parallel_calls=AUTOTUNE` runs at tf.data's default parallelism
  (at most the number of cores), and `prefetch(AUTOTUNE)` buffers still grow
  when the consumer waits (tf.data's legacy prefetch autotuner). A user who
  wants tf.data's model back sets `autotune.enabled = True` on the dataset
  and accepts the stall; we never override an explicit choice.
- The per-device stage inside `MultiDeviceIterator` (a generator and a
  `prefetch(1)`; nothing there to tune) follows the host: when the host
  pipeline's autotuning is off, so is the per-device stage's. This is a
  patch of TensorFlow's `multi_device_iterator_ops`, scoped by the dataset's
  own options (only pipelines with `autotune.enabled=False`), reversible,
  and pinned by `PATCH.pins` (`tests/test_patches.py` fails when a
  TensorFlow upgrade changes them).

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

    Args:
        dataset: A `tf.data.Dataset`; anything else is returned unchanged.

    Returns:
        `dataset` with `autotune.enabled=False`, or `dataset` itself when
        the user set any of its autotune options (`enabled` either way, or
        a budget or algorithm: a choice to tune).
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
