"""Resuming a fit where its backup left it: position, topology, data order.

A `fit` under `LocalReplicator` or `MultiWorkerReplicator` is a `Run`:
epoch, steps done in it, and the data's epoch iterator with the iterators
it made. `patches/backup_and_restore.py` (patching Keras' `BackupAndRestore`,
`CallbackList` and epoch iterator) records these and the topology in every
backup and hands them back here on restore. `replay` makes the first epoch
after a restore give an uninterrupted run's data (earlier iterators are made
again, as a seeded `reshuffle_each_iteration` shuffle draws its order per
iterator; trained batches are pulled again, untrained). A backup resumes on
any topology, except inside an epoch whose batches would differ
(`ValueError`, before any step).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

import numpy as np
import tensorflow as tf

from keras_replicator._src.core import markers
from keras_replicator._src.core import traits
from keras_replicator._src.core import versions
from keras_replicator._src.sharding import checkpoint_files
from keras_replicator._src.training import preemption

_logger = logging.getLogger("keras_replicator")

# Our own entry in BackupAndRestore's metadata (Keras reads only "epoch").
METADATA_KEY = "keras_replicator"

PARTIAL_SUFFIX = ".partial"

PREVIOUS_SUFFIX = ".previous"

# A ModelParallel backup: a sharded checkpoint here in `backup_dir`, its
# position in the checkpoint's index.
SHARDED_FOLDER = "sharded"

METADATA_FILE = "training_metadata.json"

# Keras 3.10's epoch iterators yield `(step, iterator)`.
_KERAS_3_10 = versions.keras_before("3.11")


class Run:
    """One `fit` under a replicator: its progress and pending resume."""

    def __init__(self, model):
        self.model = model
        self.strategy = traits.model_strategy(model)
        self.agreement = preemption.Agreement(self.strategy)
        # The epoch in progress and the train steps done in it.
        self.epoch = 0
        self.done = 0
        # The data's epoch iterator, and how many iterators it made.
        self.in_epochs = False
        self.iterator = None
        self.made = 0
        # What a restored backup recorded, for the data iterator.
        self.resume = None
        # Set while a preemption backs up and exits (`_stop`).
        self.stopping = False


runs: list[Run] = []


@contextlib.contextmanager
def fit_scope(model) -> Iterator[None]:
    """Preemption handling for one `fit` of `model` (no-op off replicators)."""
    if not traits.is_in_graph(traits.model_strategy(model)):
        yield
        return
    run = Run(model)
    runs.append(run)
    try:
        with preemption.handling():
            yield
    finally:
        runs.remove(run)


def run_for(model) -> Run | None:
    for run in reversed(runs):
        if run.model is model:
            return run
    return None


def position(model):
    """A function giving the epoch `model`'s fit is in, for messages."""

    def where():
        run = run_for(model)
        return None if run is None else f"epoch {run.epoch + 1}"

    return where


def handles(model) -> bool:
    """Whether a `fit` of `model` under one of our replicators is running.

    Its `BackupAndRestore._load_model` then restores any backup found, at
    the exact step.
    """
    return run_for(model) is not None


def sharded_backup(target: str) -> str | None:
    """The folder of the sharded backup to restore, if the backup is one.

    `<backup_dir>.previous` holds it if a process died between the two
    renames of a whole save replacing it. None if a whole backup was written
    later beside it (by a plain Keras `fit`, which saves in place).
    """
    for root in (target, target + PREVIOUS_SUFFIX):
        if root != target and os.path.isdir(target):
            break
        folder = os.path.join(root, SHARDED_FOLDER)
        index = os.path.join(folder, checkpoint_files.INDEX)
        if not os.path.exists(index):
            continue
        whole = os.path.join(root, METADATA_FILE)
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


def resume_from(run: Run, metadata: dict, source, target, model) -> None:
    # A stock Keras backup resumes at the saved epoch's start, as in Keras.
    run.resume = metadata.get(METADATA_KEY)
    done = run.resume or {}
    log_state(
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

    `iterations` (the optimizer's), and float64 sums of absolute values of
    the model's `weights` and the `optimizer`'s variables.
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


def log_state(what: str, model, epoch: int, done: int) -> None:
    """Debug log: a save and its restore must print the same digest."""
    if _logger.isEnabledFor(logging.DEBUG):
        _logger.debug(
            "backup %s, after step %d of epoch %d: %s",
            what,
            done,
            epoch + 1,
            state_digest(model),
        )


def topology(strategy) -> dict:
    """What a backup records of the replicator it was written under."""
    return {
        "replicator": _public_class_name(strategy),
        "workers": int(getattr(strategy, "num_workers", 1) or 1),
        "replicas": int(strategy.num_replicas_in_sync),
    }


def _public_class_name(strategy) -> str:
    """The class of `strategy` a user knows: exported, or their own.

    A multi-process mesh runs on an internal `MultiWorkerReplicator`
    subclass (`distribution/runtime.py`); messages name the documented one.
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


def _note_topology(run: Run) -> None:
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
    input_fn = markers.input_fn_of(dataset)
    if hasattr(input_fn, "shuffle_seed") and hasattr(input_fn, "policies"):
        return input_fn
    return None


def _order_by_workers(epoch_iterator, strategy) -> bool:
    """Whether the examples of each step depend on the number of workers.

    Keras splits its own data batch by batch, the same on every topology.
    `replicator.distribute` shards over workers first: on several, a shuffle
    per shard, or sharding by file or input function, changes each step.
    """
    input_fn = _sharded_input(epoch_iterator)
    workers = int(getattr(strategy, "num_workers", 1) or 1)
    if input_fn is None or workers < 2:
        return False
    policy = input_fn.policies.get(workers, "element")
    return input_fn.shuffle_seed is not None or policy != "element"


def _check_exact(epoch_iterator, resume: dict) -> None:
    """Raises ValueError if resuming inside this epoch would skip examples.

    That is, the batch count differs, or the examples per step depend on the
    worker count, which differs.
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


def data_state(run: Run) -> dict:
    """Where the training data stands: what `replay` needs."""
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


def replay(original, self, resume: dict):
    """The first epoch after a restore, data as if training never stopped.

    Keras' loop (`EpochIterator._enumerate_iterator`, pinned) makes an
    iterator per epoch unless `steps_per_epoch` is given, and another when
    an epoch used up the data. Earlier iterators are remade unused (for the
    seeded shuffle's order), then the current one's batches pulled again.
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
