"""Deleting a distributed iterator without stalling: no tf.data autotune thread.

Under `MultiWorkerReplicator`, `model.fit` returned 3-60 s after its last
step in about half the runs, the other workers waiting in their next
collective (stock `MultiWorkerMirroredStrategy` too, once a loop ran about
10 s). TensorFlow 2.21 loses a wake-up: `RootDataset`'s autotune thread
(`Model::OptimizeLoop`) sleeps between optimisations, doubling from 10 ms;
deleting the iterator cancels and joins it, but the cancellation callback
wakes it BEFORE the manager is marked cancelled
(`tsl::CancellationManager::StartCancelWithStatus`), so it sleeps out its
period. Keras deletes an iterator at the end of every `fit`/`evaluate`/
`predict` and exhausted epoch; each has an autotuned root for the host
pipeline and, in a `MultiDeviceIterator`, one per device.

For datasets our replicators distribute, the host pipeline gets
`tf.data.Options().autotune.enabled = False` unless the user set an
`autotune` option (`AUTOTUNE` parallelism is then tf.data's default, and
`prefetch(AUTOTUNE)` buffers still grow), and a pinned patch of
`multi_device_iterator_ops` gives each device's stage the host's setting.
2 workers deleting an iterator after 100 steps: 18 of 18 took 0.15-0.24 s,
where 11 of 18 took 7-62 s (benchmarks/RESULTS.md).
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

    `markers.input_fn_of` unwraps it: evaluation and resumption read the
    sharder's input functions' attributes (`padded_eval`) back.
    """
    return functools.wraps(dataset_fn)(
        lambda ctx: without_autotune_thread(dataset_fn(ctx))
    )


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
