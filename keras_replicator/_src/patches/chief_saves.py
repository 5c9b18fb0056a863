"""Keras saves called on every process: the chief writes, the others read.

A JAX-style `keras.distribution` script calls `model.save_weights(path)`,
`model.save(path)` or a `ModelCheckpoint` on every process with the same
path. Under a multi-process replicator every process then opened the same
file, and h5py's lock failed in all of them (`BlockingIOError: unable to
lock file`). The processes cannot simply skip the save either: a value
sharded by `ModelParallel` is assembled by an all-gather that every
process must join.

So on a process other than the chief, `saving_lib.save_weights_only` and
`saving_lib.save_model` walk the model exactly as the chief's save does,
in the same order, and read every value into nothing (`_NoWrites`): they
join each gather and write no file. The chief's save writes one variable
at a time, as Keras does, so no process holds the whole model. A file the
chief alone saves (`if chief: model.save_weights(...)`) still needs the
others for its gathers: `sharding/sharded.py` says so within the
collective timeout instead of waiting forever.
"""

from __future__ import annotations

from keras.src import backend
from keras.src.saving import saving_lib

from keras_replicator._src.core import traits
from keras_replicator._src.patches import registry


class _Discard(dict):
    """A store entry that reads each value (joining its gathers), keeps none."""

    def __setitem__(self, key, value):
        backend.convert_to_numpy(value)


class _NoWrites(saving_lib.H5IOStore):
    """A weights store with no file: Keras' `_save_state` walks it as one."""

    def __init__(self):  # noqa: D107 - no file, unlike H5IOStore's.
        pass

    def __bool__(self):
        return True

    def make(self, path, metadata=None):
        """An entry that discards what it is given."""
        del path, metadata
        return _Discard()

    def get(self, path):
        """Nothing was written."""
        raise KeyError(path)

    def close(self):
        """Nothing to close."""


def _reader(model) -> bool:
    """True on a non-chief process of one of our multi-process replicators."""
    strategy = getattr(model, "distribute_strategy", None)
    return (
        traits.is_ours(strategy)
        and getattr(strategy, "num_workers", 1) > 1
        and not strategy.is_chief
    )


def _read_along(model) -> None:
    if not model.built:
        raise ValueError(
            "You are saving a model that has not yet been built. Build it "
            "first (call it on some data, or `build()`)."
        )
    saving_lib._save_state(
        model,
        weights_store=_NoWrites(),
        assets_store=None,
        inner_path="",
        visited_saveables=set(),
    )


def _save(original, model, filepath, *args, **kwargs):
    # `save_weights_only` and `save_model` alike.
    if not _reader(model):
        return original(model, filepath, *args, **kwargs)
    _read_along(model)
    return None


PATCH = registry.register(
    registry.Patch(
        name="chief_saves",
        targets=(
            registry.Target(saving_lib, "save_weights_only", _save),
            registry.Target(saving_lib, "save_model", _save),
        ),
        applies_to=frozenset({"multi_worker"}),
        pins=(
            registry.Pin(
                "keras.src.saving.saving_lib",
                (
                    "def save_weights_only(",
                    "def _save_state(",
                    "weights_store.make(inner_path, metadata=metadata)",
                ),
            ),
            # `_save` passes the arguments after `filepath` on as they
            # come: Keras 3.16 (nightly builds from 3.16.0.dev) dropped
            # `weights_format`.
            registry.Pin(
                "keras.src.saving.saving_lib",
                (
                    'def save_model(model, filepath, weights_format="h5", '
                    "zipped=True):",
                ),
                keras="<3.16.0.dev0",
            ),
            registry.Pin(
                "keras.src.saving.saving_lib",
                ("def save_model(model, filepath, zipped=True):",),
                keras=">=3.16.0.dev0",
            ),
            registry.Pin(
                "keras.src.saving.saving_api",
                (
                    "saving_lib.save_weights_only(model, filepath, "
                    "max_shard_size, **kwargs)",
                    "return saving_lib.save_model(model, filepath)",
                ),
            ),
        ),
        delete_when=(
            "Keras' TensorFlow backend writes saves on one process under "
            "multi-process distributions"
        ),
    )
)
