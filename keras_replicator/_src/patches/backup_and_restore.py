"""Save at the step on preemption, atomically, and resume at that step.

Keras 3's `BackupAndRestore` saves at epoch ends (or every `save_freq`
batches), writes its two files in place (a kill mid-write leaves a backup
that does not load, or one step's weights with another's epoch), and
restarts the saved epoch from its first batch: nothing skips the batches
done, and with `save_freq` one number means "after batch 0" and "after the
epoch" (keras-team/keras#17012, #19179). Under `LocalReplicator` and
`MultiWorkerReplicator`, with no change to user code, this patch:

- tracks each `fit`'s epoch and steps done (`CallbackList` hooks) and at
  each train batch end asks `training.preemption` whether every worker
  agrees to stop; then every `BackupAndRestore` saves at that step and the
  process exits with `preemption.EXIT_CODE` (a fit without one stops too);
- writes each backup atomically: into `<backup_dir>.partial`, then two
  renames (the old one kept as `<backup_dir>.previous` between them, which
  restore falls back to), recording the exact steps done;
- on restore, has `training/resumption.py` replay an uninterrupted run's
  data order in the first epoch (trained batches pulled again, untrained)
  and check the backup's topology can resume exactly here;
- restores a sharded (`ModelParallel`) backup onto whatever the fit runs
  on, printing one line; a fit under no replicator of ours does too
  (`backup_guard`); no fit deletes a backup it did not restore;
- stops the hang watchdog's clock while a backup is written, and counts a
  train batch end as progress (`training/hang_watchdog.py`).

A fit's progress is `resumption.Run`, whose `fit_scope` (composed into `fit`
by `trainer_loops`) installs the signal handlers for one fit and puts them
back however it ends.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterator

import keras
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.callbacks import callback_list

from keras_replicator._src.core import placements
from keras_replicator._src.core import trace_events
from keras_replicator._src.core import traits
from keras_replicator._src.core import versions
from keras_replicator._src.patches import chief_only
from keras_replicator._src.patches import registry
from keras_replicator._src.sharding import checkpoint
from keras_replicator._src.sharding import sharded
from keras_replicator._src.training import hang_watchdog
from keras_replicator._src.training import preemption
from keras_replicator._src.training import resumption

_logger = logging.getLogger("keras_replicator")


# CallbackList hooks: progress, then the check after every callback ran.


def _on_epoch_begin(original, self, epoch, logs=None):
    run = resumption.run_for(self.model)
    if run is not None:
        run.epoch, run.done, run.in_epochs = epoch, 0, True
    return original(self, epoch, logs)


def _on_epoch_end(original, self, epoch, logs=None):
    run = resumption.run_for(self.model)
    if run is not None:
        # What an epoch-end backup records: the next epoch, nothing done.
        run.epoch, run.done = epoch + 1, 0
    return original(self, epoch, logs)


def _on_train_batch_end(original, self, batch, logs=None):
    run = resumption.run_for(self.model)
    if run is None:
        return original(self, batch, logs)
    run.done = versions.batch_end_step(self.model, batch) + 1
    # The step ran (the first one traced): the hang watchdog times the
    # callbacks, and counts the step once they returned.
    hang_watchdog.arm()
    original(self, batch, logs)
    hang_watchdog.beat()
    if run.agreement.should_stop():
        _stop(self, run)
    return None


def _on_train_end(original, self, logs=None):
    run = resumption.run_for(self.model)
    if run is not None and not getattr(self.model, "stop_training", False):
        # Every worker gets here after the same steps. A signal after the last
        # check: back up the end before Keras deletes the backup, and leave;
        # the restarted fit trains nothing and the script goes on (stock
        # re-delivers the signal after fit, killing the script before its
        # final save, backup gone). The workers agree with one more sum, also
        # the barrier a fit resumed at its end needs: no worker deletes the
        # backup before every worker restored it.
        if run.agreement.should_stop_at_end():
            # A fit that trained nothing leaves the restored backup as is.
            _stop(self, run, save=run.in_epochs)
    if run is not None:
        # Before `BackupAndRestore.on_train_end` deletes the backup.
        _finish_backups(abandon_deleted=True)
    return original(self, logs)


def _backups(callbacks) -> list:
    return [
        c
        for c in callbacks.callbacks
        if isinstance(c, keras.callbacks.BackupAndRestore)
    ]


def _deletes_at_end(backup) -> bool:
    """Whether Keras' own `on_train_end` deletes `backup`'s folder next.

    Not for a subclass with its own `on_train_end` (its backup is finished).
    """
    return bool(getattr(backup, "delete_checkpoint", False)) and (
        type(backup).on_train_end is _Backup.on_train_end
    )


def _deleted_unread(backup, run: resumption.Run) -> bool:
    """Whether a save of `backup` now would be deleted unread, so is skipped.

    So at the training's end when Keras' `on_train_end` deletes it next: a
    write (minutes for a large model on shared storage) for nothing. A crash
    before the deletion resumes from the previous backup, at most
    `save_freq` steps back. A preemption's backup (`_stop`) is always
    written, and so is a last-step save where the step count is unknown.
    """
    if run.stopping or not _deletes_at_end(backup):
        return False
    params = getattr(backup, "params", None) or {}
    epochs, steps = params.get("epochs"), params.get("steps")
    if not epochs:
        return False
    if run.epoch >= epochs:  # The last epoch's end.
        return True
    return bool(steps) and run.epoch == epochs - 1 and run.done >= steps


_ends = itertools.count()


def _backup_on_train_end(original, self, logs=None):
    """Keras deletes the backup; then every process waits for that.

    The chief deletes it and all read a sharded backup from one folder:
    without the wait, a process's next `fit` could find it half deleted, or
    whole and restore it while the others start afresh.
    """
    run = resumption.run_for(self.model)
    try:
        return original(self, logs)
    finally:
        if (
            run is not None
            and self.delete_checkpoint
            and sharded.multi_process(run.strategy)
        ):
            with hang_watchdog.paused():
                sharded.wait_for_processes(
                    run.strategy,
                    f"keras_replicator/backup_deleted/{next(_ends)}",
                    lambda seconds: (
                        "At the end of a fit every process waits for the "
                        "chief to delete the BackupAndRestore backup; the "
                        f"other processes did not get there within "
                        f"{seconds:g} s (one of them may have failed)."
                    ),
                    file_work=True,
                )


def _stop(callbacks, run: resumption.Run, save: bool = True) -> None:
    """Every worker at the same step: back up, then exit."""
    if getattr(callbacks, "_async_train", False):
        callbacks._flush_futures()
    backups = _backups(callbacks)
    run.stopping = True
    for backup in backups if save else ():
        backup._save_model()
    # A sharded backup writes in the background: done before the exit.
    _finish_backups(abandon_deleted=False)
    signum = preemption.pending()
    cause = "a preemption signal on another worker"
    if signum is not None:
        cause = preemption.signal_name(signum)
    if not backups:
        saved = "no BackupAndRestore callback, nothing saved"
    elif not save:
        saved = "nothing trained since the backup, kept as it is"
    elif getattr(run.strategy, "is_chief", True):
        saved = "backup written to " + ", ".join(
            os.fspath(b.backup_dir) for b in backups
        )
    else:
        saved = "the chief wrote the backup"
    where = f"after step {run.done} of epoch {run.epoch + 1}"
    if not save:
        where = "at the end"
    elif run.done == 0 and run.epoch > 0:
        where = f"at the end of epoch {run.epoch}"
    preemption.leave(
        f"preempted ({cause}): stopped {where}; {saved}; exiting with code "
        f"{preemption.EXIT_CODE}"
    )


# BackupAndRestore: atomic saves that record the step, fallback on restore.


def _local(path) -> bool:
    return "://" not in os.fspath(path)


@contextlib.contextmanager
def _paths_in(backup, directory: str) -> Iterator[None]:
    """Points `backup`'s files into `directory` for the duration."""
    root = os.fspath(backup.backup_dir)
    saved = {
        name: getattr(backup, name) for name in chief_only.BACKUP_ATTRIBUTES
    }
    try:
        for name, value in saved.items():
            setattr(backup, name, directory + os.fspath(value)[len(root) :])
        yield
    finally:
        for name, value in saved.items():
            setattr(backup, name, value)


def _save_model(original, self):
    run = resumption.run_for(self.model)
    if run is None:
        return original(self)
    if _deleted_unread(self, run):
        _logger.debug(
            "BackupAndRestore: no backup at the end of the training, "
            "which Keras deletes next (delete_checkpoint=True)."
        )
        return None
    # A save may take long; the hang watchdog's clock stops meanwhile.
    target = chief_only.real_backup_dir(self)
    with hang_watchdog.paused(), trace_events.span("backup", trace_events.SAVE):
        if _local(target) and placements.any_sharded(self.model.weights):
            return _save_sharded(self, run, target)
        return _save_atomically(original, self, run)


# Sharded backups in flight (the fit's end and a preemption's exit wait for
# them; a user's own `save_checkpoint` is not waited for there).
_backup_saves: list = []


def _finish_backups(abandon_deleted: bool) -> None:
    """Waits for this process's sharded backup in flight, if any.

    With `abandon_deleted` (a fit's end), one Keras' `on_train_end` deletes
    next (`delete_checkpoint=True`, the default) is abandoned
    (`CheckpointSave._abandon`), not finished; the previous complete backup
    stays until the deletion for a crash in between to resume from. A fit's
    first save (no previous backup) is finished.
    """
    # A long write is no hang: the watchdog's clock stops meanwhile.
    with hang_watchdog.paused():
        while _backup_saves:
            backup, save = _backup_saves.pop()
            if abandon_deleted and _deletes_at_end(backup) and save._replaces:
                save._abandon()
            else:
                save.wait()


def _save_sharded(self, run: resumption.Run, target: str) -> None:
    """Every process writes its blocks to `<backup_dir>/sharded`.

    Nothing is gathered; files are written in the background
    (`sharding/checkpoint.py`), awaited by the next save, the fit's end and a
    preemption's exit. The training position is in the index, so weights and
    position commit together; then process 0 removes a whole backup left by
    a run under another distribution.
    """
    metadata = {
        "epoch": run.epoch,
        "batch": int(getattr(self, "_last_batch_seen", 0)),
        resumption.METADATA_KEY: {
            "epoch": run.epoch,
            "steps_done": run.done,
            "topology": resumption.topology(run.strategy),
            **resumption.data_state(run),
        },
    }

    def drop_whole_backup():
        shutil.rmtree(target + resumption.PARTIAL_SUFFIX, ignore_errors=True)
        for name in (
            "_weights_path",
            "_training_metadata_path",
            "_prev_weights_path",
            "_prev_training_metadata_path",
        ):
            path = os.path.join(target, os.path.basename(getattr(self, name)))
            if os.path.exists(path):
                os.remove(path)
        shutil.rmtree(target + resumption.PREVIOUS_SUFFIX, ignore_errors=True)

    save = checkpoint.save(
        self.model,
        os.path.join(target, resumption.SHARDED_FOLDER),
        metadata=metadata,
        on_commit=drop_whole_backup,
    )
    # `checkpoint.save` waited for every earlier save (and raised its
    # error): only this one can still be in flight.
    _backup_saves[:] = [(self, save)]
    resumption.log_state(f"saving to {target}", self.model, run.epoch, run.done)


def _save_atomically(original, self, run: resumption.Run):
    target = os.fspath(self.backup_dir)
    if not _local(target):
        return original(self)
    partial = target + resumption.PARTIAL_SUFFIX
    previous = target + resumption.PREVIOUS_SUFFIX
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    if self.double_checkpoint and os.path.isdir(target):
        # Keras' "previous state" files: the backup being replaced.
        for name in ("_weights_path", "_training_metadata_path"):
            current = getattr(self, name)
            if os.path.exists(current):
                with _paths_in(self, partial):
                    shutil.copy(current, getattr(self, name) + ".bkp")
    with _paths_in(self, partial):
        original(self)
        resumption.log_state(
            f"saved to {target}", self.model, run.epoch, run.done
        )
        with open(self._training_metadata_path) as f:
            metadata = json.load(f)
        metadata["epoch"] = run.epoch
        metadata[resumption.METADATA_KEY] = {
            "epoch": run.epoch,
            "steps_done": run.done,
            "topology": resumption.topology(run.strategy),
            **resumption.data_state(run),
        }
        with open(self._training_metadata_path, "w") as f:
            json.dump(metadata, f)
    # Renames are atomic: killed anywhere here, `target` or `previous` is
    # a complete backup (restore reads `previous` when `target` is gone).
    if os.path.isdir(target):
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(target, previous)
    os.rename(partial, target)
    shutil.rmtree(previous, ignore_errors=True)
    return None


def _load_model(original, self):
    with trace_events.span("restore", trace_events.SAVE):
        return _restore(original, self)


def _restore(original, self):
    run = resumption.run_for(self.model)
    target = chief_only.real_backup_dir(self)
    if run is None or not _local(target):
        return original(self)
    # A backup of this process still being written (a fit that raised,
    # retried in a notebook) is complete before it is looked for.
    _finish_backups(abandon_deleted=False)
    sharded = resumption.sharded_backup(target)
    if sharded is not None:
        # A ModelParallel run's backup loads onto whatever this run has.
        if not self.model.built:
            return original(self)  # Keras' own error for an unbuilt model.
        source = sharded
        metadata = checkpoint.load(self.model, sharded)
        self.model._initial_epoch = metadata["epoch"]
    else:
        previous = target + resumption.PREVIOUS_SUFFIX
        only_previous = not os.path.isdir(target) and os.path.isdir(previous)
        source = previous if only_previous else target
        with _paths_in(self, source):
            original(self)
        metadata_path = os.path.join(source, resumption.METADATA_FILE)
        if not os.path.exists(metadata_path):
            return None
        with open(metadata_path) as f:
            metadata = json.load(f)
    if getattr(run.strategy, "is_chief", True):
        resumption.say_restored(
            source, metadata, resumption.describe_strategy(run.strategy)
        )
    resumption.resume_from(run, metadata, source, target, self.model)
    return None


# The data iterator: counted while training, replayed on resume.


def _get_iterator(original, self):
    run = resumption.runs[-1] if resumption.runs else None
    if run is not None and run.iterator is self:
        # Each call makes one iterator (`iter(self._get_iterator())`).
        run.made += 1
    return original(self)


def _enumerate_iterator(original, self):
    run = resumption.runs[-1] if resumption.runs else None
    if (
        run is None
        or not run.in_epochs
        or self._distribute_strategy is not run.strategy
    ):
        # Also the build's look at one batch, before any epoch: both the
        # interrupted and the resumed fit do it.
        yield from original(self)
        return
    if run.iterator is None:
        # The first one a fit enumerates is its training data.
        run.iterator = self
    resume, run.resume = run.resume, None
    if run.iterator is not self or not resume or "iterators" not in resume:
        yield from original(self)
        return
    yield from resumption.replay(original, self, resume)


_Backup = keras.callbacks.BackupAndRestore
_List = callback_list.CallbackList

PATCH = registry.register(
    registry.Patch(
        name="preemption",
        targets=(
            registry.Target(_List, "on_epoch_begin", _on_epoch_begin),
            registry.Target(_List, "on_epoch_end", _on_epoch_end),
            registry.Target(_List, "on_train_batch_end", _on_train_batch_end),
            registry.Target(_List, "on_train_end", _on_train_end),
            registry.Target(_Backup, "_save_model", _save_model),
            registry.Target(_Backup, "_load_model", _load_model),
            registry.Target(_Backup, "on_train_end", _backup_on_train_end),
            registry.Target(
                tf_trainer.TFEpochIterator,
                "_enumerate_iterator",
                _enumerate_iterator,
            ),
            registry.Target(
                tf_trainer.TFEpochIterator, "_get_iterator", _get_iterator
            ),
        ),
        applies_to=frozenset(traits.IN_GRAPH),
        pins=(
            registry.Pin(
                "keras.src.callbacks.backup_and_restore",
                (
                    "def _save_model(self):",
                    "def _load_model(self):",
                    "def on_train_end(self, logs=None):",
                    "if self.delete_checkpoint and "
                    "file_utils.exists(self.backup_dir):",
                    "self.model._initial_epoch = epoch",
                    'epoch = training_metadata["epoch"]',
                    "self.model.save_weights(filepath=self._weights_path, "
                    "overwrite=True)",
                ),
            ),
            # `resumption.replay` mirrors this loop.
            registry.Pin(
                "keras.src.trainers.epoch_iterator",
                (
                    "if self._current_iterator is None or "
                    "self.steps_per_epoch is None:",
                    "for step in range(0, steps_per_epoch, "
                    "self.steps_per_execution):",
                    "if self._num_batches and self._steps_seen >= "
                    "self._num_batches:",
                    "self._steps_seen += self.steps_per_execution",
                    "step = -self.steps_per_execution",
                ),
                attributes=("EpochIterator._interrupted_warning",),
            ),
            registry.Pin(
                "keras.src.trainers.epoch_iterator",
                ("yield step, step + self.steps_per_execution - 1, iterator",),
                keras=">=3.11",
            ),
            registry.Pin(
                "keras.src.trainers.epoch_iterator",
                ("yield step, self._current_iterator", "yield step, iterator"),
                keras="<3.11",
            ),
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                (
                    "callbacks.on_epoch_begin(epoch)",
                    "callbacks.on_epoch_end(epoch, epoch_logs)",
                    "callbacks.on_train_end(logs=training_logs)",
                    "initial_epoch = self._initial_epoch or initial_epoch",
                ),
            ),
            # `_on_train_batch_end` counts the steps done from `batch`
            # (`versions.batch_end_step`).
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                ("callbacks.on_train_batch_end(end_step, logs)",),
                keras=">=3.11",
            ),
            registry.Pin(
                "keras.src.backend.tensorflow.trainer",
                ("callbacks.on_train_batch_end(step, logs)",),
                keras="<3.11",
            ),
        ),
        delete_when=(
            "Keras' BackupAndRestore saves on preemption at the step, "
            "atomically, and resumes mid-epoch (keras-team/keras#17012, "
            "keras-team/keras#19179)"
        ),
    )
)
