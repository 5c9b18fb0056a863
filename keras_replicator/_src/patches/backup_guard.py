"""A backup `BackupAndRestore` finds is restored, whatever runs the fit.

Keras' `BackupAndRestore` looks for its own two files only. A backup our
preemption patch wrote can hold something else: a sharded checkpoint in
`<backup_dir>/sharded` (a `ModelParallel` run: every process wrote its
blocks), or, when a process was killed between the two renames of an
atomic save, the complete backup in `<backup_dir>.previous`. Under our
replicators the preemption patch restores both. But a fit that runs on
none of them (one device, as a user runs a script to debug it, or another
`tf.distribute` strategy) had stock Keras look, find nothing, train from
the first epoch and, at its end, delete `<backup_dir>` with the backup it
never read.

This patch, installed when `keras_replicator` is imported (like
`keras_distribution`: the fit may run under no replicator at all), makes
`BackupAndRestore.on_train_begin` of such a fit

- restore a sharded backup (`sharding/checkpoint.py` reads it onto one
  device, or any strategy), at the epoch it recorded, and print one line
  that says what was restored. Only our strategies replay the batches of
  an epoch already trained; here, as Keras does with its own backups, an
  epoch stopped inside starts again at its first batch, and the line says
  so. A backup that does not load here raises a `ValueError` naming it and
  `kr.load_checkpoint`, before training, so nothing deletes it;
- restore a whole backup left in `<backup_dir>.previous` (renamed back
  into place first, so that Keras reads it and deletes it at the end);
- say which whole backup of ours it restored, in the same line.

A fit under our replicators goes to the preemption patch's
`_load_model`, which restores at the exact step.
"""

from __future__ import annotations

import json
import os

import keras

from keras_replicator._src.patches import chief_only
from keras_replicator._src.patches import registry
from keras_replicator._src.sharding import checkpoint
from keras_replicator._src.training import resumption

_RESTARTS = (
    "; this epoch starts again at its first batch (only a keras.distribution "
    "distribution or a replicator resumes at the step)"
)


def _on_train_begin(original, self, logs=None):
    target = chief_only.real_backup_dir(self)
    if resumption.handles(self.model) or "://" in target:
        return original(self, logs)
    if not self.model.built:
        return original(self, logs)  # Keras' own error for an unbuilt model.
    where = resumption.describe_strategy(
        getattr(self.model, "_distribute_strategy", None)
    )
    folder = resumption.sharded_backup(target)
    if folder is not None:
        metadata = _load_sharded(self.model, folder, target)
        self.model._initial_epoch = _start_epoch(metadata)
        resumption.say_restored(folder, metadata, where, _note(metadata))
        return None
    previous = target + resumption.PREVIOUS_SUFFIX
    source = target
    if not os.path.isdir(target) and os.path.isdir(previous):
        # Killed between the renames of an atomic save: the complete one.
        os.rename(previous, target)
        source = previous
    original(self, logs)
    metadata = _whole_metadata(self)
    if metadata is not None:
        # Keras' "epoch" is the one in progress, also after its last step.
        self.model._initial_epoch = _start_epoch(metadata)
        resumption.say_restored(source, metadata, where, _note(metadata))
    return None


def _load_sharded(model, folder: str, target: str) -> dict:
    try:
        return checkpoint.load(model, folder)
    except (ValueError, TypeError, RuntimeError, OSError) as error:
        raise ValueError(
            "BackupAndRestore found a sharded backup (a ModelParallel run's) "
            f"that does not load into this model, and left it as it is: "
            f"{error}. Read it with `kr.load_checkpoint(model, {folder!r})` "
            "on a model of its structure (on any device or mesh), resume "
            f"under the distribution it was written with, or delete "
            f"{target!r} to start over. Received: backup_dir={target!r}"
        ) from error


def _whole_metadata(backup) -> dict | None:
    """Our entry of a whole backup's metadata, if Keras restored one."""
    path = backup._training_metadata_path
    if not os.path.exists(path):
        return None
    with open(path) as f:
        metadata = json.load(f)
    return metadata if resumption.METADATA_KEY in metadata else None


def _finished_epoch(metadata: dict) -> bool:
    """Whether the backup was written after the last step of its epoch."""
    ours = metadata.get(resumption.METADATA_KEY) or {}
    done, batches = ours.get("steps_done", 0), ours.get("num_batches")
    return bool(done and batches and done >= batches)


def _start_epoch(metadata: dict) -> int:
    return int(metadata["epoch"]) + (1 if _finished_epoch(metadata) else 0)


def _note(metadata: dict) -> str:
    ours = metadata.get(resumption.METADATA_KEY) or {}
    if ours.get("steps_done") and not _finished_epoch(metadata):
        return _RESTARTS
    return ""


PATCH = registry.register(
    registry.Patch(
        name="backup_guard",
        targets=(
            registry.Target(
                keras.callbacks.BackupAndRestore,
                "on_train_begin",
                _on_train_begin,
            ),
        ),
        # Installed at import (`distribution/api.py`), not by a kind.
        applies_to=frozenset(),
        pins=(
            registry.Pin(
                "keras.src.callbacks.backup_and_restore",
                (
                    "def on_train_begin(self, logs=None):",
                    "self._load_model()",
                    "self.model._initial_epoch = epoch",
                    "file_utils.rmtree(self.backup_dir)",
                ),
            ),
        ),
        delete_when=(
            "never: Keras' BackupAndRestore does not know our sharded "
            "backups (keep while `sharding/checkpoint.py` writes them)"
        ),
    )
)
