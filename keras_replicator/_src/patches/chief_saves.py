"""Keras saves called on every process: the chief writes, the others read.

A JAX-style script calls `model.save_weights(path)`, `model.save(path)` or a
`ModelCheckpoint` on every process with one path: each opened the file and
h5py's lock failed (`BlockingIOError: unable to lock file`). Skipping is no
way out: a `ModelParallel` value is assembled by an all-gather all join.

So on non-chiefs `saving_lib.save_weights_only` and `saving_lib.save_model`
walk the model as the chief's save does and read every value into nothing
(`_NoWrites`): they join each gather and write nothing. The chief writes one
variable at a time, as Keras does: no process holds the whole model.

Barriers before and after the write make a save return everywhere once the
chief closed the file, and keep it from rewriting a file another process
reads (`save_weights(p)` then `load_weights(p)` in a loop). A save is so
collective, as under `MultiWorkerMirroredStrategy`: a chief-only save fails
within the collective timeout (else the start-up timeout, else 60 s) with an
error that says so. The wait for the chief's write, and the others' waits
between its reads of sharded values (`sharded.waiting_on_files`), allow at
least 600 s (`sharded.FILE_WORK_SECONDS`: many GB take minutes), with the
hang watchdog's clock stopped (at most 5 times its timeout). A failing chief
posts its error in the coordination service's key-value store before the
last barrier, and the others raise it at once. A sharded `BackupAndRestore`
backup does not come here: it writes in the background.
"""

from __future__ import annotations

import itertools

from keras.src import backend
from keras.src.saving import saving_lib

from keras_replicator._src.core import traits
from keras_replicator._src.patches import registry
from keras_replicator._src.sharding import sharded
from keras_replicator._src.training import hang_watchdog

# Saves of this process, counted alike on every process (each barrier id is
# used once per cluster).
_saves = itertools.count()


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


def _processes(model):
    """The model's multi-process replicator, or None."""
    strategy = getattr(model, "distribute_strategy", None)
    if (
        traits.kind(strategy) == "multi_worker"
        and getattr(strategy, "num_workers", 1) > 1
    ):
        return strategy
    return None


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


def _together(strategy, number: int, stage: str, filepath) -> None:
    if stage == "end":
        # The others wait for the chief's write: work on a file.
        def message(seconds):
            return (
                "A Keras save under a multi-process distribution returns on "
                "every process once the chief has closed the file; the "
                f"chief did not finish writing it within {seconds:g} s (it "
                f"may have failed). Received: filepath={str(filepath)!r}"
            )

    else:

        def message(seconds):
            return (
                "A Keras save under a multi-process distribution is written "
                "by the chief and returns on every process once the file is "
                "complete, so every process must call it at the same point "
                "(`save_weights`, `save` and `ModelCheckpoint` on every "
                "process, with one path), not under `if chief:`. The other "
                f"processes did not reach the start of this save within "
                f"{seconds:g} s. Received: filepath={str(filepath)!r}"
            )

    sharded.wait_for_processes(
        strategy,
        f"keras_replicator/save/{number}/{stage}",
        message,
        file_work=stage == "end",
    )


def _save(original, model, filepath, *args, **kwargs):
    # `save_weights_only` and `save_model` alike.
    strategy = _processes(model)
    if strategy is None:
        return original(model, filepath, *args, **kwargs)
    number = next(_saves)
    failure = None
    with hang_watchdog.paused(), sharded.waiting_on_files():
        # Every process is done with the file (a `load_weights` of the
        # last save) before the chief opens it for writing.
        _together(strategy, number, "start", filepath)
        result = None
        if strategy.is_chief:
            try:
                result = original(model, filepath, *args, **kwargs)
            except Exception as error:  # Re-raised below, once said.
                failure = error
            # What became of the file, for the others: they raise the
            # chief's error at once rather than at the end of their wait.
            sharded.publish(
                _outcome_key(number), "" if failure is None else repr(failure)
            )
        else:
            _read_along(model)
        # The chief has closed the file: it is complete for every process.
        try:
            _together(strategy, number, "end", filepath)
        except RuntimeError:
            if failure is None:
                raise
        if failure is not None:
            raise failure
        if not strategy.is_chief:
            _raise_if_the_chief_failed(number, filepath)
    return result


def _outcome_key(number: int) -> str:
    return f"keras_replicator/save/{number}/outcome"


def _raise_if_the_chief_failed(number: int, filepath) -> None:
    # Published by the chief before it reached the barrier just passed.
    outcome = sharded.published(
        _outcome_key(number),
        60,
        lambda seconds: (
            "A Keras save under a multi-process distribution is written by "
            "the chief, whose outcome could not be read within "
            f"{seconds:g} s (it may have failed). "
            f"Received: filepath={str(filepath)!r}"
        ),
    )
    if outcome:
        raise RuntimeError(
            "A Keras save under a multi-process distribution is written by "
            f"the chief, whose write failed: {outcome}. Received: "
            f"filepath={str(filepath)!r}"
        )


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
