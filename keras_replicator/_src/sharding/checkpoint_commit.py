"""A sharded checkpoint's commit across processes, and background saves.

The barriers at a save's start (in the caller's thread), the write of this
process's part and process 0's commit of the index (in a background thread,
polling files), and the handle of a save in flight. `checkpoint.py` says why
the commit is the index's rename.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import sys
import threading
import time

from keras_replicator._src.sharding import checkpoint_files
from keras_replicator._src.sharding import sharded

DEFAULT_TIMEOUT = sharded.FILE_WORK_SECONDS

_logger = logging.getLogger("keras_replicator")


class CheckpointSave:
    """A save in flight: `wait()` blocks until its index is written.

    Returned by `kr.save_checkpoint`; already done if `asynchronous=False`.

    Attributes:
        directory: The checkpoint directory.
        name: The checkpoint's subdirectory (`"ckpt-<step>"`).
    """

    def __init__(self, directory, name, thread=None):
        self.directory = directory
        self.name = name
        self._thread = thread
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._number = 0  # The save's barrier number (`agree`).
        # Whether a complete checkpoint (an abandoned save leaves one) was
        # there when it began.
        self._replaces = False
        self._processes = 1
        self._timeout = DEFAULT_TIMEOUT

    def done(self) -> bool:
        """Whether the files and the index are written (or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Blocks until the save is complete.

        Raises:
            The error the background write raised, if any.
        """
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _abandon(self) -> None:
        """Stops the write where it is; every process calls it.

        For a save nobody will read: the backup the end of `fit` deletes next.
        The writer stops at its next block (8 MB written or 16 MB
        checksummed) and removes this process's files; process 0 commits no
        index unless it already had, so the directory keeps the previous
        complete checkpoint (or this one). Returns after a barrier, once every
        writer has stopped, so none creates files in a folder being deleted.
        An error the write met is dropped.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._error = None
        barrier(
            f"{self._number}/abandoned",
            self._processes,
            self._timeout,
            "A sharded backup in flight at the end of a fit is abandoned by "
            "every process together.",
        )


_save_numbers = itertools.count()

# The save in flight in this process (at most one: the next waits).
_pending: list[CheckpointSave] = []

_pending_lock = threading.Lock()


def wait_for_saves() -> None:
    """Blocks until this process's save in flight, if any, is complete."""
    with _pending_lock:
        pending = list(_pending)
        _pending.clear()
    for save_ in pending:
        save_.wait()


def barrier(name, processes, timeout, what=None) -> None:
    if processes == 1:
        return
    what = what or (
        "A sharded checkpoint is written by every process: call "
        "`save_checkpoint` on every process, at the same point."
    )
    sharded.barrier_of_processes(
        f"keras_replicator/checkpoint/{name}",
        timeout,
        lambda seconds: (
            f"{what} The other processes did not reach {name!r} within "
            f"{seconds:g} s."
        ),
    )


def commit(
    directory, name, processes, metadata, on_commit=None, sequence=0
) -> None:
    """Process 0: merges the parts into the index, then drops old saves."""
    folder = directory / name
    merged: dict[str, dict] = {}
    for k in range(processes):
        try:
            with open(folder / f"process-{k}.json") as f:
                part = json.load(f)
        except FileNotFoundError as error:
            raise RuntimeError(
                f"Process {k} wrote its part of the sharded checkpoint, but "
                f"process 0 cannot see it: every process must write to "
                f"storage all of them see (one host's disk, or a shared "
                f"file system). Received: directory={str(directory)!r}"
            ) from error
        for key, entry in part.items():
            blocks = [
                {**b, "file": f"{name}/{b['file']}"} for b in entry["blocks"]
            ]
            if key in merged:
                merged[key]["blocks"].extend(blocks)
            else:
                merged[key] = {**entry, "blocks": blocks}
    index = {
        "format": checkpoint_files.FORMAT,
        "version": checkpoint_files.VERSION,
        "checkpoint": name,
        "processes": processes,
        "sequence": sequence,
        "metadata": metadata,
        "variables": merged,
    }
    temporary = directory / (checkpoint_files.INDEX + ".tmp")
    with open(temporary, "w") as f:
        json.dump(index, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, directory / checkpoint_files.INDEX)
    checkpoint_files.sync_folder(directory)
    if on_commit is not None:
        on_commit()
    for old in directory.glob("ckpt-*"):
        if old.name != name and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def agree(processes, timeout) -> int:
    """In the caller's thread: every process's previous save is done.

    A barrier: process 0 reaches it only after its previous save committed
    (`wait_for_saves`), so all then read the same index and name the save
    alike. Returns the save's number among the cluster's saves (made in the
    same order everywhere; 0, uncounted, in one process), which keeps
    barrier ids (used once per cluster) apart.
    """
    if processes == 1:
        return 0
    number = next(_save_numbers)
    barrier(f"{number}/previous_done", processes, timeout)
    return number


def begin(directory, name, process, processes, timeout, number) -> None:
    """In the caller's thread: an empty folder for the save, seen by all.

    Process 0 removes what an uncommitted save (a crash) left under this
    name; a barrier then keeps everyone from writing before it is clean.
    """
    folder = directory / name
    if process == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    if processes > 1:
        barrier(f"{number}/{name}/begin", processes, timeout)
        folder.mkdir(parents=True, exist_ok=True)


def write(
    directory,
    name,
    sequence,
    process,
    processes,
    parts,
    metadata,
    timeout,
    on_commit,
    stop=None,
):
    """Writes this process's part; process 0 then commits the index.

    Runs in the background thread. Its waits poll files: the coordination
    service's barrier holds Python's GIL while it waits, which would stop
    training. Raises `checkpoint_files.Abandoned` where it finds `stop` set,
    before the commit.
    """
    folder = directory / name
    checkpoint_files.write_part(folder, process, parts, stop)
    checkpoint_files.sync_folder(folder)
    if process == 0:
        wait_for(
            lambda: all(
                (folder / f"process-{k}.json").exists()
                for k in range(processes)
            ),
            timeout,
            f"every process's part of {folder}",
            directory,
            stop,
        )
        checkpoint_files.check(stop)
        commit(directory, name, processes, metadata, on_commit, sequence)


def wait_for(condition, timeout, what, directory, stop=None) -> None:
    deadline = time.monotonic() + timeout
    pause = 0.005
    while not condition():
        checkpoint_files.check(stop)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"A sharded checkpoint is written by every process: call "
                f"`save_checkpoint` on every process, at the same point, "
                f"with a directory every process sees (one host's disk, or "
                f"a shared file system). {what} did not appear within "
                f"{timeout:g} s. Received: directory={str(directory)!r}"
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.2)


def yield_to_training() -> None:
    """Lowers this (writer) thread's CPU priority, where the OS allows it.

    At nice 19 the writer's checksums and copies take only the cores the
    training step leaves. Linux only, where a thread is a task of its own and
    `setpriority` on its id leaves the rest of the process as it was.
    """
    if not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def start(handle, arguments, timeout, on_commit) -> None:
    """Writes and commits `handle`'s save in a background thread.

    `arguments` are `write`'s first seven. An abandoned save's files here
    go; another error is kept for `handle.wait()` and logged at once (a
    script may never wait for its last save).
    """
    directory, name, _, process = arguments[:4]

    def run():
        try:
            yield_to_training()
            write(*arguments, timeout, on_commit, handle._stop)
        except checkpoint_files.Abandoned:
            for path in checkpoint_files.part_files(directory / name, process):
                with contextlib.suppress(OSError):
                    path.unlink()
        except BaseException as error:  # Re-raised by `wait()`.
            handle._error = error
            _logger.error(
                "keras-replicator: the sharded checkpoint %s in %s was not "
                "written: %r (the previous one stays)",
                name,
                directory,
                error,
            )

    thread = threading.Thread(
        target=run, name="keras_replicator-checkpoint", daemon=False
    )
    handle._thread = thread
    with _pending_lock:
        _pending.append(handle)
    thread.start()
