"""Save at the step on preemption, atomically, and resume at that step.

Keras 3's `BackupAndRestore` saves at epoch ends (or every `save_freq`
batches), writes its two files in place (a process killed while writing
leaves a backup that does not load, or weights of one step with the epoch
of another), and on restore restarts the saved epoch from its first batch:
its metadata records the batch, but nothing skips the batches done, and
with `save_freq` the same number means "after batch 0" and "after the
epoch" (keras-team/keras#17012, #19179). Under `LocalReplicator` and
`MultiWorkerReplicator` this patch, with no change to user code:

- tracks, per `fit`, the epoch and the steps done in it (`CallbackList`
  epoch and batch hooks), and at each train batch end asks
  `training.preemption` whether every worker agrees to stop; then every
  `BackupAndRestore` of the fit saves at that step and the process exits
  with `preemption.EXIT_CODE`. A fit without one stops at the step too;
- writes every backup of `BackupAndRestore` atomically: into
  `<backup_dir>.partial`, then two renames (the old backup is kept as
  `<backup_dir>.previous` between them), so a process killed at any point
  leaves a complete backup: the new one, or the previous one, which
  restoring falls back to. The metadata also records the exact steps done;
- on restore, makes the first epoch of the fit replay the data order of an
  uninterrupted run: the data iterators the earlier epochs made are made
  again (a seeded `reshuffle_each_iteration` shuffle draws its order per
  iterator) and the batches already trained in the epoch are skipped. Only
  their input pipeline runs, no training step;
- records the topology (replicator, workers, replicas) in every backup. A
  backup resumes on any other topology: weights and optimizer state are
  the same variables everywhere, and Keras splits each global batch over
  the replicas. Where the batches of the epoch in progress would differ
  there (another number of batches, or `replicator.distribute` data whose
  steps depend on the number of workers), a mid-epoch resume raises a
  `ValueError` that says so, instead of skipping or repeating examples;
- restores a sharded backup (a `ModelParallel` run's) onto whatever the
  fit runs on, and prints one line naming it. A fit under none of our
  replicators restores it too (`backup_guard`); no fit deletes a backup
  it did not restore;
- stops the hang watchdog's clock while a backup is written, and counts a
  train batch end as its progress (`training/hang_watchdog.py`).

`fit_scope` (composed into `fit` by `trainer_loops`) installs the signal
handlers for one fit and puts them back after it, however it ends.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.callbacks import callback_list

from keras_replicator._src.core import placements
from keras_replicator._src.core import traits
from keras_replicator._src.core import versions
from keras_replicator._src.patches import chief_only
from keras_replicator._src.patches import registry
from keras_replicator._src.sharding import checkpoint
from keras_replicator._src.sharding import sharded
from keras_replicator._src.training import hang_watchdog
from keras_replicator._src.training import preemption

# Our own entry in BackupAndRestore's metadata (Keras reads only "epoch").
METADATA_KEY = "keras_replicator"
PARTIAL_SUFFIX = ".partial"
PREVIOUS_SUFFIX = ".previous"
# A ModelParallel model's backup: a sharded checkpoint in this folder of
# `backup_dir`, its training position in the checkpoint's index.
SHARDED_FOLDER = "sharded"
_METADATA_FILE = "training_metadata.json"
_logger = logging.getLogger("keras_replicator")

# Keras 3.10's epoch iterators yield `(step, iterator)`.
_KERAS_3_10 = versions.keras_before("3.11")


class _Run:
    """One `fit` under a replicator: its progress and pending resume."""

    def __init__(self, model):
        self.model = model
        self.strategy = traits.model_strategy(model)
        self.agreement = preemption.Agreement(self.strategy)
        # The epoch in progress and the train steps done in it.
        self.epoch = 0
        self.done = 0
        # The training data's epoch iterator and the iterators it made
        # since the first epoch began.
        self.in_epochs = False
        self.iterator = None
        self.made = 0
        # What a restored backup recorded, for the data iterator.
        self.resume = None
        # Set while a preemption backs up and exits (`_stop`).
        self.stopping = False


_runs: list[_Run] = []


@contextlib.contextmanager
def fit_scope(model) -> Iterator[None]:
    """Preemption handling for one `fit` of `model` (no-op off replicators).

    Args:
        model: The model whose `fit` runs inside.
    """
    if not traits.is_in_graph(traits.model_strategy(model)):
        yield
        return
    run = _Run(model)
    _runs.append(run)
    try:
        with preemption.handling():
            yield
    finally:
        _runs.remove(run)


def _run_for(model) -> _Run | None:
    for run in reversed(_runs):
        if run.model is model:
            return run
    return None


def position(model):
    """A function giving the epoch `model`'s fit is in, for messages."""

    def where():
        run = _run_for(model)
        return None if run is None else f"epoch {run.epoch + 1}"

    return where


# CallbackList hooks: progress, then the check after every callback ran.


def _on_epoch_begin(original, self, epoch, logs=None):
    run = _run_for(self.model)
    if run is not None:
        run.epoch, run.done, run.in_epochs = epoch, 0, True
    return original(self, epoch, logs)


def _on_epoch_end(original, self, epoch, logs=None):
    run = _run_for(self.model)
    if run is not None:
        # What an epoch-end backup records: the next epoch, nothing done.
        run.epoch, run.done = epoch + 1, 0
    return original(self, epoch, logs)


def _on_train_batch_end(original, self, batch, logs=None):
    run = _run_for(self.model)
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
    run = _run_for(self.model)
    if run is not None and not getattr(self.model, "stop_training", False):
        # Every worker gets here together, after the same steps. A signal
        # after the last check: the training is done, but the process was
        # asked to leave. Back up the end before Keras deletes the backup,
        # and leave: the restarted script's fit trains nothing and goes on
        # to what follows it. (Stock behaviour re-delivers the signal after
        # fit, killing the script before its own final save, with the
        # backup already gone.) Several workers agree with one more sum,
        # which is also the barrier a fit that trained nothing (resumed at
        # its end) needs: no worker deletes the backup before every worker
        # restored it.
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

    Not so for a subclass with an `on_train_end` of its own: what it does
    is not known, so its backup in flight is finished.
    """
    return bool(getattr(backup, "delete_checkpoint", False)) and (
        type(backup).on_train_end is _Backup.on_train_end
    )


def _deleted_unread(backup, run: _Run) -> bool:
    """Whether a save of `backup` now would be deleted unread, so is skipped.

    So at the training's end (the last epoch's last step, or its end) when
    Keras' own `on_train_end` deletes the backup next: the save would cost
    its write (minutes of a large model's, on shared storage) for nothing.
    A crash before the deletion resumes from the previous backup, at most
    `save_freq` steps back, as a crash between any two saves does. A
    preemption's backup (`_stop`) is always written: the restarted script
    skips the fit it finished. Where the number of steps is not known (a
    dataset of unknown length), a save at the last step is written; the
    last epoch's end is known either way (`save_freq="epoch"`).
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

    Over several processes the chief deletes it, and every process reads
    a sharded backup from the one folder: without the wait, a process
    whose next `fit` began at once could find the backup half deleted
    (an index whose files are gone), or whole, and restore it while the
    others start afresh.
    """
    run = _run_for(self.model)
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


def _stop(callbacks, run: _Run, save: bool = True) -> None:
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
    run = _run_for(self.model)
    if run is None:
        return original(self)
    if _deleted_unread(self, run):
        _logger.debug(
            "BackupAndRestore: no backup at the end of the training, "
            "which Keras deletes next (delete_checkpoint=True)."
        )
        return None
    # A save may take long; the hang watchdog's clock stops meanwhile.
    with hang_watchdog.paused():
        target = chief_only.real_backup_dir(self)
        if _local(target) and _has_sharded_variables(self.model):
            return _save_sharded(self, run, target)
        return _save_atomically(original, self, run)


# Sharded backups in flight (the fit's end and a preemption's exit wait for
# them; a user's own `save_checkpoint` is not waited for there).
_backup_saves: list = []


def _finish_backups(abandon_deleted: bool) -> None:
    """Waits for this process's sharded backup in flight, if any.

    With `abandon_deleted` (a fit's end), one that Keras' `on_train_end`
    deletes next (`delete_checkpoint=True`, the default) is abandoned
    (`CheckpointSave._abandon`) rather than finished only to be deleted:
    the fit's end does not wait for its write. The previous complete
    backup stays until the deletion, so a crash in between (or a callback
    whose `on_train_end` raises first) resumes from it. With no previous
    backup (the fit's first save), the save is finished: nothing else
    would be there to resume from.
    """
    # A long write is no hang: the watchdog's clock stops meanwhile.
    with hang_watchdog.paused():
        while _backup_saves:
            backup, save = _backup_saves.pop()
            if abandon_deleted and _deletes_at_end(backup) and save._replaces:
                save._abandon()
            else:
                save.wait()


def _has_sharded_variables(model) -> bool:
    return any(placements.of(v) is not None for v in model.weights)


def _save_sharded(self, run: _Run, target: str) -> None:
    """Every process writes its blocks to `<backup_dir>/sharded`.

    No variable is gathered; the files are written in the background
    (`sharding/checkpoint.py`), and the next save, the end of the fit and
    a preemption's exit wait for them. The training position goes into the
    checkpoint's index, so weights and position commit together. Once the
    index is in place, process 0 removes a whole backup left from a run
    under another distribution.
    """
    metadata = {
        "epoch": run.epoch,
        "batch": int(getattr(self, "_last_batch_seen", 0)),
        METADATA_KEY: {
            "epoch": run.epoch,
            "steps_done": run.done,
            "topology": topology(run.strategy),
            **_data_state(run),
        },
    }

    def drop_whole_backup():
        shutil.rmtree(target + PARTIAL_SUFFIX, ignore_errors=True)
        for name in (
            "_weights_path",
            "_training_metadata_path",
            "_prev_weights_path",
            "_prev_training_metadata_path",
        ):
            path = os.path.join(target, os.path.basename(getattr(self, name)))
            if os.path.exists(path):
                os.remove(path)
        shutil.rmtree(target + PREVIOUS_SUFFIX, ignore_errors=True)

    save = checkpoint.save(
        self.model,
        os.path.join(target, SHARDED_FOLDER),
        metadata=metadata,
        on_commit=drop_whole_backup,
    )
    # `checkpoint.save` waited for every earlier save (and raised its
    # error): only this one can still be in flight.
    _backup_saves[:] = [(self, save)]
    _log_state(f"saving to {target}", self.model, run.epoch, run.done)


def _save_atomically(original, self, run: _Run):
    target = os.fspath(self.backup_dir)
    if not _local(target):
        return original(self)
    partial = target + PARTIAL_SUFFIX
    previous = target + PREVIOUS_SUFFIX
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
        _log_state(f"saved to {target}", self.model, run.epoch, run.done)
        with open(self._training_metadata_path) as f:
            metadata = json.load(f)
        metadata["epoch"] = run.epoch
        metadata[METADATA_KEY] = {
            "epoch": run.epoch,
            "steps_done": run.done,
            "topology": topology(run.strategy),
            **_data_state(run),
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
    run = _run_for(self.model)
    target = chief_only.real_backup_dir(self)
    if run is None or not _local(target):
        return original(self)
    # A backup of this process still being written (a fit that raised,
    # retried in a notebook) is complete before it is looked for.
    _finish_backups(abandon_deleted=False)
    sharded = sharded_backup(target)
    if sharded is not None:
        # A ModelParallel run's backup loads onto whatever this run has.
        if not self.model.built:
            return original(self)  # Keras' own error for an unbuilt model.
        metadata = checkpoint.load(self.model, sharded)
        self.model._initial_epoch = metadata["epoch"]
        if getattr(run.strategy, "is_chief", True):
            say_restored(sharded, metadata, describe_strategy(run.strategy))
        _resume_from(run, metadata, sharded, target, self.model)
        return None
    source = target
    if not os.path.isdir(target) and os.path.isdir(target + PREVIOUS_SUFFIX):
        source = target + PREVIOUS_SUFFIX
    with _paths_in(self, source):
        original(self)
    metadata_path = os.path.join(source, _METADATA_FILE)
    if os.path.exists(metadata_path):
        with open(metadata_path) as f:
            metadata = json.load(f)
        if getattr(run.strategy, "is_chief", True):
            say_restored(source, metadata, describe_strategy(run.strategy))
        _resume_from(run, metadata, source, target, self.model)
    return None


def handles(model) -> bool:
    """Whether a `fit` of `model` under one of our replicators is running.

    Its `BackupAndRestore._load_model` then restores whatever backup it
    finds, at the exact step (`_load_model` above).
    """
    return _run_for(model) is not None


def sharded_backup(target: str) -> str | None:
    """The folder of the sharded backup to restore, if the backup is one.

    `<backup_dir>.previous` holds it when a process was killed between the
    two renames of a whole save that replaced it. A whole backup written
    later beside it (by a `fit` Keras ran alone, which saves in place and
    leaves the folder) is the one to restore: the sharded one is then not
    returned.
    """
    for root in (target, target + PREVIOUS_SUFFIX):
        if root != target and os.path.isdir(target):
            break
        folder = os.path.join(root, SHARDED_FOLDER)
        index = os.path.join(folder, checkpoint.INDEX)
        if not os.path.exists(index):
            continue
        whole = os.path.join(root, _METADATA_FILE)
        if os.path.exists(whole) and (
            os.stat(whole).st_mtime_ns > os.stat(index).st_mtime_ns
        ):
            return None
        return folder
    return None


def describe_strategy(strategy) -> str:
    """Where a backup is restored, for the line that says so."""
    if traits.is_ours(strategy):
        return _describe(topology(strategy))
    name = type(strategy).__name__
    # No strategy: TensorFlow's default one, or none recorded.
    if strategy is None or name.startswith("_Default"):
        return "one device"
    return name


def say_restored(source, metadata: dict, where: str, note: str = "") -> None:
    """Prints the one line that says which backup was restored, and where."""
    ours = metadata.get(METADATA_KEY) or {}
    epoch = ours.get("epoch", metadata.get("epoch", 0))
    done = ours.get("steps_done", 0)
    position = f"at the start of epoch {epoch + 1}"
    if done:
        position = f"after step {done} of epoch {epoch + 1}"
    saved = ours.get("topology")
    written = f", written on {_describe(saved)}" if saved else ""
    preemption.say(
        f"restored the backup {os.fspath(source)} "
        f"({position}{written}) on {where}{note}"
    )


def _resume_from(run: _Run, metadata: dict, source, target, model) -> None:
    # Without our entry (a backup of stock Keras) the fit starts at the
    # saved epoch's first step, as in Keras.
    run.resume = metadata.get(METADATA_KEY)
    done = run.resume or {}
    _log_state(
        f"restored from {source}",
        model,
        done.get("epoch", metadata.get("epoch", 0)),
        done.get("steps_done", 0),
    )
    if run.resume:
        run.resume["backup_dir"] = target
        _note_topology(run)


def state_digest(model) -> dict:
    """Checksums of what a backup carries, to compare a save and a restore.

    Returns:
        `iterations` (the optimizer's step count), and `weights` and
        `optimizer`: sums of the absolute values of the model's weights and
        of the optimizer's variables, in float64.
    """

    def total(variables):
        return float(
            sum(
                np.abs(np.asarray(v.numpy(), np.float64)).sum()
                for v in variables
            )
        )

    optimizer = getattr(model, "optimizer", None)
    variables = list(optimizer.variables) if optimizer is not None else []
    return {
        "iterations": (
            int(optimizer.iterations.numpy()) if optimizer is not None else None
        ),
        "weights": total(model.weights),
        "optimizer": total(variables),
    }


def _log_state(what: str, model, epoch: int, done: int) -> None:
    """Debug log: a save and its restore must print the same digest."""
    if _logger.isEnabledFor(logging.DEBUG):
        _logger.debug(
            "backup %s, after step %d of epoch %d: %s",
            what,
            done,
            epoch + 1,
            state_digest(model),
        )


# The topology: recorded in every backup, checked on resume.


def topology(strategy) -> dict:
    """What a backup records of the replicator it was written under."""
    return {
        "replicator": _public_class_name(strategy),
        "workers": int(getattr(strategy, "num_workers", 1) or 1),
        "replicas": int(strategy.num_replicas_in_sync),
    }


def _public_class_name(strategy) -> str:
    """The class of `strategy` a user knows: exported, or their own.

    A mesh over several processes runs on an internal subclass of
    `MultiWorkerReplicator` (`distribution/runtime.py`); messages name
    `MultiWorkerReplicator`, which the documentation does.
    """
    # Read, not imported: the package imports this patch.
    package = sys.modules.get("keras_replicator")
    for cls in type(strategy).__mro__:
        if not cls.__module__.startswith("keras_replicator."):
            return cls.__name__  # the user's own, or TensorFlow's
        if getattr(package, cls.__name__, None) is cls:
            return cls.__name__
    return type(strategy).__name__


def _describe(saved: dict) -> str:
    workers = saved.get("workers", 1)
    replicas = saved.get("replicas", "?")
    name = saved.get("replicator", "a replicator")
    if workers > 1:
        return f"{name} ({workers} workers, {replicas} replicas)"
    return f"{name} ({replicas} replicas)"


def _note_topology(run: _Run) -> None:
    """Says so when a backup resumes on another topology (chief only)."""
    saved = run.resume.get("topology")
    now = topology(run.strategy)
    if not saved or not getattr(run.strategy, "is_chief", True):
        return
    if (saved.get("workers"), saved.get("replicas")) == (
        now["workers"],
        now["replicas"],
    ):
        return
    print(
        f"[keras-replicator] resuming a backup written on "
        f"{_describe(saved)} on {_describe(now)}, with the same global "
        "batch.",
        file=sys.stderr,
        flush=True,
    )


def _sharded_input(epoch_iterator):
    """Our sharder's input function behind the fit's data, if it is one."""
    dataset = getattr(epoch_iterator.data_adapter, "_dataset", None)
    input_fn = getattr(dataset, "_dataset_fn", None)
    if hasattr(input_fn, "shuffle_seed") and hasattr(input_fn, "policies"):
        return input_fn
    return None


def _order_by_workers(epoch_iterator, strategy) -> bool:
    """Whether the examples of each step depend on the number of workers.

    Keras' own data (arrays, datasets) is split batch by batch, the same on
    every topology. `replicator.distribute` shards the examples over the
    workers first: on several workers, a shuffle within each shard, or
    shards by file or by the input function, put other examples in a step.
    """
    input_fn = _sharded_input(epoch_iterator)
    workers = int(getattr(strategy, "num_workers", 1) or 1)
    if input_fn is None or workers < 2:
        return False
    policy = input_fn.policies.get(workers, "element")
    return input_fn.shuffle_seed is not None or policy != "element"


def _check_exact(epoch_iterator, resume: dict) -> None:
    """Raises when resuming inside this epoch would skip or repeat examples.

    Raises:
        ValueError: If the backup was written inside an epoch whose batches
            differ here: another number of batches, or data whose examples
            per step depend on the number of workers, which differs.
    """
    done = resume["steps_done"]
    saved = resume.get("topology")
    recorded, current = resume.get("num_batches"), epoch_iterator._num_batches
    if not done or not saved or (recorded and done >= recorded):
        # An epoch-end backup: the next epoch starts afresh anywhere.
        return
    strategy = epoch_iterator._distribute_strategy
    now = topology(strategy)
    problems = []
    if recorded and current and recorded != current:
        problems.append(
            f"its epochs had {recorded} batches and have {current} here"
        )
    if saved.get("workers", 1) != now["workers"] and (
        resume.get("order_by_workers")
        or _order_by_workers(epoch_iterator, strategy)
    ):
        problems.append(
            "its data (`replicator.distribute` with a `shuffle_seed`, or "
            "sharded by file or by the input function) puts other examples "
            "in each step on another number of workers"
        )
    if not problems:
        return
    raise ValueError(
        "This backup cannot resume exactly here: it was written after step "
        f"{done} of epoch {resume['epoch'] + 1} on {_describe(saved)}, and "
        f"on {_describe(now)} {' and '.join(problems)}, so finishing that "
        "epoch would skip some examples and repeat others. Resume on the "
        "same topology, or from a backup written at an epoch end "
        "(`BackupAndRestore(save_freq='epoch')`; the next epoch then "
        "starts afresh on any topology), or delete the backup to start "
        f"over. Received: backup_dir={resume.get('backup_dir')!r}, "
        f"backup topology={saved}, this topology={now}"
    )


# The data iterator: counted while training, replayed on resume.


def _get_iterator(original, self):
    run = _runs[-1] if _runs else None
    if run is not None and run.iterator is self:
        # Each call makes one iterator (`iter(self._get_iterator())`).
        run.made += 1
    return original(self)


def _enumerate_iterator(original, self):
    run = _runs[-1] if _runs else None
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
    yield from _resumed(original, self, resume)


def _data_state(run: _Run) -> dict:
    """Where the training data stands: what `_resumed` needs to replay."""
    it = run.iterator
    if it is None:
        return {}
    return {
        "iterators": run.made,
        "batches_seen": it._steps_seen,
        "num_batches": it._num_batches,
        "current": it._current_iterator is not None,
        "order_by_workers": _order_by_workers(it, run.strategy),
    }


def _resumed(original, self, resume: dict):
    """The first epoch after a restore, data as if training never stopped.

    Keras' loop (`EpochIterator._enumerate_iterator`, pinned) makes a new
    iterator per epoch unless `steps_per_epoch` is given, and another one
    when an epoch used up the data. A seeded shuffle with
    `reshuffle_each_iteration` draws its order per iterator, so the
    iterators made before are made again (unused), then the batches the
    current one gave are pulled again, untrained.
    """
    done = resume["steps_done"]
    _check_exact(self, resume)
    if self._num_batches is None:
        # Learnt in the first epoch of an unknown-cardinality dataset.
        self._num_batches = resume["num_batches"]
    iterator = None
    for i in range(resume["iterators"]):
        iterator = iter(self._get_iterator())
        if i < resume["iterators"] - 1:
            iterator = None
    try:
        for _ in range(resume["batches_seen"] if iterator else 0):
            next(iterator)
    except (StopIteration, tf.errors.OutOfRangeError):
        iterator = None
    if done == 0:
        # An epoch start: Keras' own loop goes on from the same state.
        self._current_iterator = iterator if resume["current"] else None
        self._steps_seen = resume["batches_seen"]
        yield from original(self)
        return
    if iterator is None:
        return
    per_call = self.steps_per_execution
    self.data_adapter.on_epoch_begin()
    steps_per_epoch = self.steps_per_epoch or self._num_batches or -1
    if steps_per_epoch > 0:
        self._current_iterator = iterator
        self._steps_seen = resume["batches_seen"]
        for step in range(done, steps_per_epoch, per_call):
            if self._num_batches and self._steps_seen >= self._num_batches:
                if self.steps_per_epoch:
                    self._interrupted_warning()
                break
            self._steps_seen += per_call
            yield _epoch_item(step, per_call, self._current_iterator)
        if self._num_batches and self._steps_seen >= self._num_batches:
            self._current_iterator = iter(self._get_iterator())
            self._steps_seen = 0
    else:
        step = done - per_call
        while True:
            step += per_call
            self._steps_seen = step + per_call
            yield _epoch_item(step, per_call, iterator)
    self.data_adapter.on_epoch_end()


def _epoch_item(step, per_call, iterator):
    """What Keras' epoch iterator yields for an execution from `step`."""
    if _KERAS_3_10:
        # Keras 3.10 yields `(step, iterator)`; 3.11 added the end step.
        # TODO: delete when the oldest supported Keras is 3.11.
        return step, iterator
    return step, step + per_call - 1, iterator


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
            # `_resumed` mirrors this loop.
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
