"""A backup `BackupAndRestore` finds is restored, whatever runs the fit.

Keras' `BackupAndRestore` looks for its own two files. Ours may hold a
sharded checkpoint in `<backup_dir>/sharded` (a `ModelParallel` run) or, for
a process killed between an atomic save's renames, the complete backup in
`<backup_dir>.previous`. Our replicators restore both; a fit on none (one
device while debugging, another strategy) found nothing, trained from the
first epoch and deleted the backup at its end.

Installed at import (the fit may run under no replicator), this makes such a
fit's `BackupAndRestore.on_train_begin`

- restore a sharded backup (`sharding/checkpoint.py` reads it onto one
  device or any strategy) at its recorded epoch, printing one line; an epoch
  stopped inside restarts at its first batch, as Keras does (only our
  strategies replay), and the line says so. One that does not load raises a
  `ValueError` naming it and `kr.load_checkpoint` before training, so
  nothing deletes it;
- restore a whole backup in `<backup_dir>.previous` (renamed back first, so
  Keras reads and later deletes it), naming it in the same line.

Under our replicators the preemption patch's `_load_model` restores at the
exact step.
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
