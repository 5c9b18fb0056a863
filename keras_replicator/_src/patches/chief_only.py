"""Side effects once per cluster: files and progress bars on the chief only.

Every worker runs the same `model.fit`, so every `ModelCheckpoint`,
`TensorBoard`, `CSVLogger` and `BackupAndRestore` would race on the same
paths (tensorflow/tensorflow#31070). Non-chiefs cannot skip the writes:
saving reads metric variables, a collective all must join. tf-keras sent
their writes to a temporary directory (`distributed_file_utils`); Keras 3
dropped that. This patch brings it back on `CallbackList.__init__`, for our
replicators on a non-chief only:

- the callbacks' file paths point at a fresh temporary directory
  (`BackupAndRestore` restores from the chief's real backup first; a model
  with sharded variables backs up into the real one from every process:
  `real_backup_dir`, `patches/backup_and_restore.py`);
- the progress bar is dropped;
- at the end of fit/evaluate/predict the paths are restored and the
  directory deleted.

A call that raises runs no `*_end` hook; its paths are restored once it is
known to be over: its `CallbackList` is collected (a script caught the
error), or the next call starts and its frame executes in no thread (a
notebook's traceback keeps it alive). A nested call (a callback calling
`predict`) is not mistaken for it: the outer frame still executes. At exit
the directories go in any case.

`PATCH.pins` records the Keras signature and attributes this relies on;
`tests/test_patches.py` fails when a Keras upgrade changes them.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import shutil
import sys
import tempfile
import threading
import weakref

import keras
from keras.src.callbacks import callback_list

from keras_replicator._src.core import traits
from keras_replicator._src.patches import registry

# Attributes holding each file-writing callback's output path.
PATH_ATTRIBUTES = (
    (keras.callbacks.ModelCheckpoint, ("filepath",)),
    (keras.callbacks.CSVLogger, ("filename",)),
    (keras.callbacks.TensorBoard, ("log_dir",)),
)
# BackupAndRestore derives these from `backup_dir` in its __init__.
BACKUP_ATTRIBUTES = (
    "backup_dir",
    "_weights_path",
    "_training_metadata_path",
    "_prev_weights_path",
    "_prev_training_metadata_path",
)

# Cleanups of calls that have not finished them yet. Guarded by its own
# re-entrant lock: a garbage collection inside a guarded block may run a
# `CallbackList` finalizer, which finishes a cleanup on the same thread.
_unfinished = set()
_unfinished_lock = threading.RLock()
_created = itertools.count()
# Keras' methods whose CallbackLists are finished once their frames end.
_KERAS_CALLERS = ("fit", "evaluate", "predict")


def _init(
    original,
    self,
    callbacks=None,
    add_history=False,
    add_progbar=False,
    model=None,
    **params,
):
    strategy = getattr(model, "distribute_strategy", None)
    if traits.is_ours(strategy) and not strategy.is_chief:
        finish_abandoned()
        callbacks = redirect(callbacks, strategy.worker_index)
        add_progbar = False
        # Frame 0 is this function, 1 the registry's wrapper, 2 the caller.
        callbacks[-1].track(self, sys._getframe(2))
    original(
        self,
        callbacks,
        add_history=add_history,
        add_progbar=add_progbar,
        model=model,
        **params,
    )


PATCH = registry.register(
    registry.Patch(
        name="chief_only",
        targets=(
            registry.Target(callback_list.CallbackList, "__init__", _init),
        ),
        applies_to=frozenset({"multi_worker"}),
        pins=(
            registry.Pin(
                "keras.src.callbacks.callback_list",
                (
                    "def __init__(",
                    "callbacks=None,",
                    "add_history=False,",
                    "add_progbar=False,",
                    "model=None,",
                    "**params,",
                ),
            ),
            # BackupAndRestore derives these paths from `backup_dir`.
            registry.Pin(
                "keras.src.callbacks.backup_and_restore",
                (
                    "self.backup_dir = backup_dir",
                    "self._weights_path = file_utils.join(",
                    "self._training_metadata_path = file_utils.join(",
                    "self._prev_training_metadata_path = (",
                ),
            ),
        ),
        delete_when=(
            "Keras 3 writes files on the chief only under multi-worker "
            "strategies, as tf-keras' distributed_file_utils did "
            "(tensorflow/tensorflow#31070)"
        ),
    )
)


def real_backup_dir(backup) -> str:
    """`backup`'s own `backup_dir`, also while its writes are redirected."""
    return getattr(
        backup, "_keras_replicator_backup_dir", os.fspath(backup.backup_dir)
    )


def redirect(callbacks, worker_index: int) -> list:
    """Sends a non-chief worker's file writes to a temporary directory.

    Returns a new list of `callbacks` (a list, a nest or None): no progress
    bars, paths in a new directory named with `worker_index`, plus internal
    callbacks that switch `BackupAndRestore` to it after restoring and
    clean up at the end.
    """
    flat = keras.tree.flatten(callbacks) if callbacks else []
    flat = [c for c in flat if not isinstance(c, keras.callbacks.ProgbarLogger)]
    tmp = tempfile.mkdtemp(prefix=f"keras_replicator_worker{worker_index}_")
    cleanup = _Cleanup(tmp)
    out = []
    for i, callback in enumerate(flat):
        out.append(callback)
        slot = os.path.join(tmp, str(i))
        # Keras creates some parent directories itself, CSVLogger doesn't.
        os.makedirs(slot)
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            # Restore reads the chief's backup; only the writes move.
            out.append(_RetargetBackup(callback, slot, cleanup))
            continue
        for cls, names in PATH_ATTRIBUTES:
            if isinstance(callback, cls):
                for name in names:
                    cleanup.move(callback, name, _inside(slot, callback, name))
    out.append(cleanup)
    return out


def finish_abandoned() -> None:
    """Restores the paths of Keras calls that raised and are over.

    A call is over when the frame of Keras' fit/evaluate/predict that
    created its `CallbackList` is not executing in any thread (a frame kept
    only by a traceback is not). Nested calls finish innermost first.
    """
    # Candidates before frames: a call starting meanwhile in another thread
    # is not a candidate, and one already running shows in the frames.
    with _unfinished_lock:
        candidates = tuple(_unfinished)
    executing = set()
    for frame in sys._current_frames().values():
        while frame is not None:
            executing.add((id(frame), frame.f_code))
            frame = frame.f_back
    abandoned = [
        c
        for c in candidates
        if c.frame_key is not None and c.frame_key not in executing
    ]
    for cleanup in sorted(abandoned, key=lambda c: -c.order):
        cleanup.finish()


def _inside(slot: str, callback, name: str) -> str:
    path = os.fspath(getattr(callback, name)).rstrip("/\\")
    return os.path.join(slot, os.path.basename(path) or "out")


class _Cleanup(keras.callbacks.Callback):
    """Puts paths back and deletes the temporary directory at the end."""

    def __init__(self, tmp: str):
        super().__init__()
        self._tmp = tmp
        self._moved = []
        self._training = False
        self.frame_key = None
        self.order = next(_created)
        self._finalizer = None
        # After a crash no *_end hook runs; still delete at exit.
        self._at_exit = functools.partial(shutil.rmtree, tmp, True)
        atexit.register(self._at_exit)
        with _unfinished_lock:
            _unfinished.add(self)

    def track(self, callback_list_, frame) -> None:
        """Finishes when `callback_list_` is collected, or is abandoned.

        Only one made by Keras' fit/evaluate/predict is abandoned when its
        creating frame ends (`finish_abandoned`). The frame is kept by id and
        code (no reference, no leak): it lives while the list does.
        """
        code = frame.f_code
        if code.co_name in _KERAS_CALLERS and "keras" in code.co_filename:
            self.frame_key = (id(frame), code)
        self._finalizer = weakref.finalize(callback_list_, self.finish)

    def move(self, callback, name: str, value: str) -> None:
        """Sets `callback.<name>` to `value` until the end."""
        self._moved.append((callback, name, getattr(callback, name)))
        setattr(callback, name, value)

    def finish(self):
        """Restores the paths and deletes the directory (idempotent)."""
        with _unfinished_lock:
            _unfinished.discard(self)
        if self._finalizer is not None:
            self._finalizer.detach()
        for callback, name, value in reversed(self._moved):
            setattr(callback, name, value)
        self._moved = []
        shutil.rmtree(self._tmp, ignore_errors=True)
        atexit.unregister(self._at_exit)

    def on_train_begin(self, logs=None):
        self._training = True

    def on_train_end(self, logs=None):
        self._training = False
        self.finish()

    def on_test_end(self, logs=None):
        # fit() runs validation through the same callbacks: not the end yet.
        if not self._training:
            self.finish()

    def on_predict_end(self, logs=None):
        self.finish()


class _RetargetBackup(keras.callbacks.Callback):
    """After `BackupAndRestore` restored, moves its writes to `slot`."""

    def __init__(self, backup, slot: str, cleanup: _Cleanup):
        super().__init__()
        self._backup = backup
        self._slot = slot
        self._cleanup = cleanup

    def on_train_begin(self, logs=None):
        original = self._backup.backup_dir
        # A sharded backup is written by every process, into the real one.
        self._backup._keras_replicator_backup_dir = os.fspath(original)
        for name in BACKUP_ATTRIBUTES:
            value = os.fspath(getattr(self._backup, name))
            moved = self._slot + value[len(os.fspath(original)) :]
            self._cleanup.move(self._backup, name, moved)
