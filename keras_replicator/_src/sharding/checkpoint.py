"""Sharded checkpoints: every process writes its own blocks; any mesh reads.

A checkpoint is a directory:

```
directory/
  index.json            # what every file holds; written last, atomically
  ckpt-<step>/
    process-<k>.bin     # process k's blocks, raw bytes in C order
    process-<k>.json    # process k's part of the index
```

- **Saving** gathers nothing. Under `ModelParallel` a process writes the
  blocks its replicas hold, each distinct block once (the lowest replica
  that holds a block writes it). A replicated variable (`DataParallel`, a
  plain replicator, a variable no layout splits, optimizer counters) is
  written once, by process 0. Each block carries a CRC-32.
- **The index is the commit.** Once every process has written and synced
  its files (process 0 sees each part's `process-<k>.json`, renamed into
  place last), process 0 merges the parts into `index.json.tmp` and renames
  it over `index.json`; another process's save ends with its part. Process
  0 waits by polling the files: the coordination service's barrier holds
  Python's GIL while it waits, which would stop training. Two barriers at
  the start of a save, in the caller's thread, make sure every process's
  previous save is done (so all read the same index and name the save
  alike) and that process 0 has emptied its folder. A crash or SIGTERM
  before the rename leaves the previous index, which names only files of
  a complete checkpoint; the previous checkpoint's files are removed only
  after the rename.
- **Asynchronous saves.** `save` copies this process's blocks to host
  memory and returns; a background thread writes the files and the index.
  The next `save` (or a `load`) first waits for the previous one.
- **Loading onto any mesh.** A process reads, for each block it now holds,
  only the saved blocks that intersect it, through memory maps (the pages
  of the bytes it copies, plus, with `verify=True`, one pass over each
  touched block for its checksum). The index is checked against the model
  (every variable present, same shapes and dtypes) before any weight
  changes. A checkpoint saved on one mesh and process count loads on
  another, under `DataParallel` and on one device.

Why files of our own rather than `tf.train.Checkpoint` or TensorStore:
`tf.train.Checkpoint` saves a `MirroredVariable` as its primary component,
which for a sharded variable is one block (and its per-task sharding writes
every variable from the task that holds it, not blocks with coordinates);
TensorStore would be a new dependency for what raw bytes, `numpy.memmap` and
a JSON index do here. The files assume storage every process sees (a local
disk on one host, a shared file system across hosts), as PyTorch's
distributed checkpoint and Orbax do.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import mmap
import os
import pathlib
import shutil
import sys
import threading
import time
import zlib
from typing import Any

import numpy as np
import tensorflow as tf

from keras_replicator._src.core import placements
from keras_replicator._src.sharding import sharded

FORMAT = "keras-replicator-sharded-checkpoint"
VERSION = 1
INDEX = "index.json"
_logger = logging.getLogger("keras_replicator")
_CRC_CHUNK = 1 << 24  # bytes per checksum update: a bounded transient
_DEFAULT_TIMEOUT = sharded.FILE_WORK_SECONDS


class CheckpointSave:
    """A save in flight: `wait()` blocks until its index is written.

    Returned by `kr.save_checkpoint`. With `asynchronous=False` it is
    already done.

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
        self._number = 0  # The save's barrier number (`_agree`).
        # Whether a complete checkpoint was there when it began (which an
        # abandoned save leaves).
        self._replaces = False
        self._processes = 1
        self._timeout = _DEFAULT_TIMEOUT

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

        For a save nobody will read: the backup that the end of `fit`
        deletes next, whose write the fit would otherwise wait for. The
        writer stops at its next block, 8 MB written or 16 MB checksummed,
        and removes this process's files; process 0 commits
        no index unless it already had, so the directory still holds the
        previous complete checkpoint (or this one). Returns once every
        process's writer has stopped (a barrier), so that no writer still
        creates files in a folder that is being deleted. An error the
        write met is dropped: nobody reads the save.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._error = None
        _barrier(
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


def _variables(model, build_optimizer: bool = False) -> dict[str, Any]:
    """`{key: variable}` for the model's weights and its optimizer's.

    Keys are `"model/<i>"` and `"optimizer/<i>"`, in the order of
    `model.weights` and `optimizer.variables`: variables match by the
    model's structure, as in Keras' own weight files, not by paths, which
    carry auto-numbered names (`sequential_2/...`) that differ between
    runs. The index records each path for messages.
    """
    optimizer = getattr(model, "optimizer", None)
    if build_optimizer and optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    found = {f"model/{i}": v for i, v in enumerate(model.weights)}
    if optimizer is not None and optimizer.built:
        found.update(
            {f"optimizer/{i}": v for i, v in enumerate(optimizer.variables)}
        )
    return found


def _strategy_of(variables) -> Any:
    for variable in variables:
        inner = getattr(variable, "_value", variable)
        strategy = getattr(inner, "distribute_strategy", None)
        if strategy is not None:
            return strategy
    return None


def _process(strategy) -> tuple[int, int]:
    """(this process's index, the process count) of `strategy`."""
    if strategy is None or not sharded.multi_process(strategy):
        return 0, 1
    local = len(strategy.extended.worker_devices)
    return (
        int(getattr(strategy.extended, "_id_in_cluster", 0)),
        strategy.num_replicas_in_sync // local,
    )


def _snapshot(component) -> np.ndarray:
    """A host value of one variable component, as it is now.

    On the CPU this copies nothing: the array holds the variable's buffer,
    and TensorFlow's updates copy a buffer that is still read before they
    write (copy-on-write), so later steps never change the array. The save
    thus costs the step no copy at all, and a variable updated before the
    writer let go of its snapshot costs one, in its update. Elsewhere
    `np.asarray` copies the value to the host.
    """
    return np.asarray(component.value())


def _first_copy(variable) -> np.ndarray:
    """This process's first copy of a replicated variable.

    A plain read of one component, so that it works whatever strategy or
    distribution is current (a model saved after another was built).
    """
    inner = getattr(variable, "_value", variable)
    copies = getattr(inner, "values", None) or (inner,)
    return _snapshot(copies[0])


def _numpy_dtype(name: str):
    return tf.as_dtype(name).as_numpy_dtype


def _host_blocks(key, variable, process) -> tuple[dict, list]:
    """This process's part of `variable`: its index entry and host copies.

    Returns:
        `(entry, blocks)`: `entry` names the dtype, shape and layout;
        `blocks` lists `(begin, array)` this process writes.
    """
    inner = getattr(variable, "_value", variable)
    dtype = tf.as_dtype(inner.dtype).name
    shape = [int(d) for d in variable.shape]
    placement = placements.of(variable)
    entry = {
        "path": variable.path,
        "dtype": dtype,
        "shape": shape,
        "layout": None,
    }
    blocks = []
    if placement is None:
        if process == 0:
            value = _first_copy(variable)
            blocks.append(([0] * len(shape), value))
        return entry, blocks
    entry["layout"] = [
        None if a is None else placement.axis_names[a]
        for a in placement.dim_axes
    ]
    entry["mesh_shape"] = list(placement.mesh_shape)
    strategy = inner.distribute_strategy
    owners: dict[tuple, int] = {}
    for r in range(placement.num_devices):
        owners.setdefault(placement.begin(r), r)
    for r, component in zip(
        sharded.local_replicas(strategy), inner.values, strict=True
    ):
        begin = placement.begin(r)
        if owners[begin] == r:
            blocks.append((list(begin), _snapshot(component)))
    return entry, blocks


def _checksum(array, stop=None) -> int:
    flat = np.asarray(array, order="C").reshape(-1).view(np.uint8)
    crc = 0
    for start in range(0, flat.size, _CRC_CHUNK):
        _check(stop)
        crc = zlib.crc32(flat[start : start + _CRC_CHUNK], crc)
    return crc


class _DirectFile:
    """Writes a file's bytes in order past the page cache (`O_DIRECT`).

    A background save writes hundreds of MB while training runs. Written
    through the page cache, each page is allocated and copied by the
    kernel, and the steps beside the writer slowed by several times the
    writer's own CPU (benchmarks/RESULTS.md, "Backups"). With `O_DIRECT`
    the bytes go from one page-aligned staging buffer to the disk. Where
    the platform or the file system has no `O_DIRECT` (macOS, tmpfs on
    older kernels), the same calls write through the page cache. The file
    is the same either way: the bytes in order, nothing between them.
    """

    _ALIGN = 4096  # Every disk's logical block size divides it.
    _STAGING = 8 * 2**20

    def __init__(self, path, stop=None):
        self._stop = stop
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self._direct = hasattr(os, "O_DIRECT")
        try:
            direct = os.O_DIRECT if self._direct else 0
            self._fd = os.open(path, flags | direct, 0o644)
        except OSError:
            if not self._direct:
                raise
            self._direct = False
            self._fd = os.open(path, flags, 0o644)
        self._staging = mmap.mmap(-1, self._STAGING)  # Page-aligned.
        self._view = np.frombuffer(self._staging, np.uint8)
        self._filled = 0
        self._offset = 0  # Of the staging buffer's first byte in the file.

    def write(self, raw) -> None:
        raw = raw.reshape(-1).view(np.uint8)
        start = 0
        while start < raw.size:
            n = min(raw.size - start, self._STAGING - self._filled)
            self._view[self._filled : self._filled + n] = raw[start : start + n]
            self._filled += n
            start += n
            if self._filled == self._STAGING:
                _check(self._stop)
                self._flush(self._STAGING)

    def _flush(self, length) -> None:
        # Released on the way out, also on an error: a view that a
        # traceback keeps would stop `discard` closing the buffer.
        with memoryview(self._staging)[:length] as chunk:
            try:
                os.pwritev(self._fd, [chunk], self._offset)
            except OSError as error:
                # EINVAL: this file system refuses O_DIRECT writes after all.
                if not self._direct or error.errno != errno.EINVAL:
                    raise
                import fcntl  # POSIX, as O_DIRECT is.

                self._direct = False
                fcntl.fcntl(
                    self._fd,
                    fcntl.F_SETFL,
                    fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT,
                )
                os.pwritev(self._fd, [chunk], self._offset)
        self._offset += length
        self._filled = 0

    def close(self) -> None:
        """Writes the rest, trims the padding and syncs; then closes."""
        try:
            size = self._offset + self._filled
            if self._filled:
                padded = -(-self._filled // self._ALIGN) * self._ALIGN
                self._view[self._filled : padded] = 0
                self._flush(padded if self._direct else self._filled)
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        finally:
            self.discard()

    def discard(self) -> None:
        """Closes without writing what is staged (a failed write)."""
        os.close(self._fd)
        del self._view
        self._staging.close()


class _Abandoned(Exception):
    """The save was abandoned (`CheckpointSave._abandon`)."""


def _check(stop) -> None:
    if stop is not None and stop.is_set():
        raise _Abandoned()


def _part_files(folder, process) -> tuple:
    """Process k's data, its part of the index, and that part's draft."""
    return tuple(
        folder / f"process-{process}{suffix}"
        for suffix in (".bin", ".json", ".json.tmp")
    )


def _write_part(folder, process, parts, stop=None) -> None:
    """Writes `process-<k>.bin` and `process-<k>.json`, synced."""
    data, part, temporary = _part_files(folder, process)
    manifest = {}
    offset = 0
    f = _DirectFile(data, stop)
    try:
        for key, (entry, blocks) in parts.items():
            written = []
            for i, (begin, array) in enumerate(blocks):
                # The snapshot is let go once written: a variable whose
                # buffer no snapshot holds is updated in place, without
                # TensorFlow's copy-on-write (`_snapshot`).
                blocks[i] = (begin, None)
                _check(stop)
                raw = np.asarray(array, order="C")
                # Bytes as they are (a buffer of ml_dtypes' bfloat16 or
                # float8 does not cast to "B").
                f.write(raw)
                written.append(
                    {
                        "file": data.name,
                        "begin": begin,
                        "shape": list(raw.shape),
                        "offset": offset,
                        "nbytes": raw.nbytes,
                        "crc32": _checksum(raw, stop),
                    }
                )
                offset += raw.nbytes
                del array, raw
            manifest[key] = {**entry, "blocks": written}
    except BaseException:
        f.discard()
        raise
    f.close()
    # Renamed into place: process 0 reads a part once its name exists.
    with open(temporary, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, part)


def _sync_folder(folder) -> None:
    """Makes new or renamed entries of `folder` durable (POSIX)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # Not every file system syncs a folder.
    finally:
        os.close(descriptor)


def _barrier(name, processes, timeout, what=None) -> None:
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


def _commit(
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
        "format": FORMAT,
        "version": VERSION,
        "checkpoint": name,
        "processes": processes,
        "sequence": sequence,
        "metadata": metadata,
        "variables": merged,
    }
    temporary = directory / (INDEX + ".tmp")
    with open(temporary, "w") as f:
        json.dump(index, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, directory / INDEX)
    _sync_folder(directory)
    if on_commit is not None:
        on_commit()
    for old in directory.glob("ckpt-*"):
        if old.name != name and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _agree(processes, timeout) -> int:
    """In the caller's thread: every process's previous save is done.

    Over several processes a barrier: process 0 reaches it only after its
    previous save committed its index (`wait_for_saves`), so every process
    then reads the same index and names the new save alike. Barrier ids
    are used once per cluster: the save's number among this cluster's
    saves (every process makes them in the same order; a save of one
    process alone does not count) keeps them apart.

    Returns:
        The save's number (0 in one process).
    """
    if processes == 1:
        return 0
    number = next(_save_numbers)
    _barrier(f"{number}/previous_done", processes, timeout)
    return number


def _begin(directory, name, process, processes, timeout, number) -> None:
    """In the caller's thread: an empty folder for the save, seen by all.

    Process 0 removes what a save that never committed (a crash) left
    under this name; a barrier then makes sure nobody writes into the
    folder before it is clean.
    """
    folder = directory / name
    if process == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    if processes > 1:
        _barrier(f"{number}/{name}/begin", processes, timeout)
        folder.mkdir(parents=True, exist_ok=True)


def _write(
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

    Runs in the background thread. The waits here poll files with sleeps
    rather than the coordination service's barrier, which holds Python's
    GIL while it waits and would stop this process's training meanwhile.
    Raises `_Abandoned` where `stop` is found set, before the commit.
    """
    folder = directory / name
    _write_part(folder, process, parts, stop)
    _sync_folder(folder)
    if process == 0:
        _wait_for(
            lambda: all(
                (folder / f"process-{k}.json").exists()
                for k in range(processes)
            ),
            timeout,
            f"every process's part of {folder}",
            directory,
            stop,
        )
        _check(stop)
        _commit(directory, name, processes, metadata, on_commit, sequence)
    # The other processes are done once their part is written: the next
    # save's first barrier waits for process 0's commit. (Waiting here for
    # the index could outlive it: at the end of a fit process 0 commits,
    # then `BackupAndRestore` deletes the backup.)


def _wait_for(condition, timeout, what, directory, stop=None) -> None:
    deadline = time.monotonic() + timeout
    pause = 0.005
    while not condition():
        _check(stop)
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


def _read_index(directory) -> dict | None:
    try:
        with open(pathlib.Path(directory) / INDEX) as f:
            index = json.load(f)
    except FileNotFoundError:
        return None
    if index.get("format") != FORMAT:
        raise ValueError(
            f"{directory} is not a keras-replicator sharded checkpoint. "
            f"Received: format={index.get('format')!r}, expected {FORMAT!r}"
        )
    if index.get("version", 0) > VERSION:
        raise ValueError(
            f"The checkpoint in {directory} has format version "
            f"{index['version']}; this keras-replicator reads up to "
            f"{VERSION}. Received: version={index['version']}"
        )
    return index


def _agreed_name(
    model, directory, step, process, processes, number, timeout
) -> tuple[str, int, bool]:
    """`_name` as process 0 reads it, the same on every process.

    Process 0 committed the index it reads (`_agree` passed its previous
    save); another host's network file system may still show the folder
    as it was (a cached lookup). So process 0 publishes what it read in
    the coordination service's key-value store, and the others take it.
    """
    step = _step(model, step)  # A bad `step` fails on every process alike.
    key = f"keras_replicator/checkpoint/{number}/name"
    if process == 0 or processes == 1:
        found = _name(directory, step)
        if processes > 1:
            sharded.publish(key, json.dumps(found))
        return found
    text = sharded.published(
        key,
        timeout,
        lambda seconds: (
            "A sharded checkpoint is named by process 0, which did not "
            f"name this one within {seconds:g} s (it may have failed). "
            f"Received: directory={str(directory)!r}"
        ),
    )
    name, sequence, replaces = json.loads(text)
    return name, sequence, replaces


def _step(model, step) -> int:
    """The step a checkpoint is named after: `step`, else the optimizer's."""
    if step is None:
        optimizer = getattr(model, "optimizer", None)
        step = (
            int(_first_copy(optimizer.iterations))
            if optimizer is not None and optimizer.built
            else 0
        )
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(
            f"`step` must be an integer or None. Received: step={step!r}"
        )
    return int(step)


def _name(directory, step: int) -> tuple[str, int, bool]:
    """The new checkpoint's name, its number, and whether one is there.

    The third: whether `directory` holds a committed checkpoint (which an
    abandoned save leaves). Read from the committed index (the last save's
    "indexed" barrier is passed), not from a directory listing.
    """
    name = f"ckpt-{step}"
    index = _read_index(directory)
    sequence = 0 if index is None else index.get("sequence", 0) + 1
    if index is not None and index["checkpoint"] == name:
        # The same step saved again: a new name, so that the committed
        # files stay until the new index replaces them.
        name = f"ckpt-{step}-{sequence}"
    return name, sequence, index is not None


def save(
    model,
    directory,
    *,
    step=None,
    metadata=None,
    asynchronous=True,
    timeout_seconds=_DEFAULT_TIMEOUT,
    on_commit=None,
) -> CheckpointSave:
    """Saves `model`'s weights and optimizer state as a sharded checkpoint.

    Every process calls it at the same point, with the same directory. See
    the module docstring for the format. Under `ModelParallel` no sharded
    variable is gathered: each process writes the blocks it holds.

    Args:
        model: A Keras model (built).
        directory: The checkpoint directory (created if missing).
        step: The step the checkpoint's name carries. Defaults to the
            optimizer's iteration count (0 before the first step).
        metadata: A JSON-serialisable dict stored in the index and returned
            by `load` (a training position, a config). Defaults to `{}`.
        asynchronous: If True (the default), return once this process's
            blocks are copied to host memory and write in a background
            thread; the returned handle's `wait()` blocks until the index
            is written. If False, return when it is.
        timeout_seconds: How long a process waits for the others at each
            stage over several processes, in seconds. Defaults to 600.
        on_commit: If set, called without arguments in process 0 once the
            index is in place (before older checkpoints are removed).

    Returns:
        A `CheckpointSave`.

    Raises:
        TypeError: If `metadata` is not JSON-serialisable, or `step` is not
            an integer.
        ValueError: If two variables share a path.
    """
    metadata = {} if metadata is None else metadata
    try:
        json.dumps(metadata)
    except TypeError as error:
        raise TypeError(
            "`metadata` must be a JSON-serialisable dict. "
            f"Received: metadata={metadata!r}"
        ) from error
    wait_for_saves()
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    variables = _variables(model)
    strategy = _strategy_of(variables.values())
    process, processes = _process(strategy)
    number = _agree(processes, timeout_seconds)
    name, sequence, replaces = _agreed_name(
        model, directory, step, process, processes, number, timeout_seconds
    )
    _begin(directory, name, process, processes, timeout_seconds, number)
    parts = {
        key: _host_blocks(key, variable, process)
        for key, variable in variables.items()
    }
    arguments = (directory, name, sequence, process, processes, parts, metadata)
    if not asynchronous:
        _write(*arguments, timeout_seconds, on_commit)
        return CheckpointSave(directory, name)
    handle = CheckpointSave(directory, name)
    handle._number, handle._processes = number, processes
    handle._timeout = timeout_seconds
    handle._replaces = replaces

    def run():
        try:
            _yield_to_training()
            _write(*arguments, timeout_seconds, on_commit, handle._stop)
        except _Abandoned:
            for path in _part_files(directory / name, process):
                try:
                    path.unlink()
                except OSError:
                    pass
        except BaseException as error:  # Re-raised by `wait()`.
            handle._error = error
            # Also said now: a script may never wait for its last save.
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
    return handle


def _yield_to_training() -> None:
    """Lowers this (writer) thread's CPU priority, where the OS allows it.

    The writer's checksums and copies into the page cache compete with
    the training step for the cores; at the lowest priority (nice 19) it
    takes what the step leaves, so the step stays as fast as without a
    save, and the save finishes as fast as without training once the
    caller waits for it. Linux only: there a thread is a task of its own,
    and `setpriority` on its id leaves the rest of the process as it was.
    Elsewhere the writer runs at the process's priority.
    """
    if not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass


class _Reader:
    """Reads any box of one variable from the blocks that intersect it."""

    def __init__(self, directory, key, entry, verify):
        self._directory = directory
        self._key = key
        self._entry = entry
        self._dtype = _numpy_dtype(entry["dtype"])
        self._verify = verify
        self._checked: set[int] = set()

    def _block(self, i, block):
        shape = tuple(block["shape"])
        if block["nbytes"] == 0:
            return np.zeros(shape, self._dtype)
        mapped = np.memmap(
            self._directory / block["file"],
            dtype=self._dtype,
            mode="r",
            offset=block["offset"],
            shape=shape or (1,),
        ).reshape(shape)
        if self._verify and i not in self._checked:
            if _checksum(mapped) != block["crc32"]:
                raise ValueError(
                    "A block of the sharded checkpoint is corrupt (its "
                    "CRC-32 differs from the index's). Received: variable="
                    f"{self._key!r}, block begin={block['begin']}, file="
                    f"{block['file']!r}"
                )
            self._checked.add(i)
        return mapped

    def verify(self, begin, shape) -> None:
        """Checks the checksums of the blocks the box `begin, shape` needs."""
        for i, block, _, _ in self._pieces(begin, shape):
            self._block(i, block)

    def read(self, begin, shape) -> np.ndarray:
        out = np.empty(tuple(shape), self._dtype)
        for i, block, source, target in self._pieces(begin, shape):
            out[target] = self._block(i, block)[source]
        return out

    def _pieces(self, begin, shape):
        """`(index, block, source box, target box)` of each block needed."""
        for i, block in enumerate(self._entry["blocks"]):
            starts = zip(begin, block["begin"], strict=True)
            low = [max(a, b) for a, b in starts]
            high = [
                min(a + n, b + m)
                for a, n, b, m in zip(
                    begin, shape, block["begin"], block["shape"], strict=True
                )
            ]
            if any(lo >= hi for lo, hi in zip(low, high, strict=True)):
                continue  # This block holds none of the box.
            source = tuple(
                slice(lo - b, hi - b)
                for lo, hi, b in zip(low, high, block["begin"], strict=True)
            )
            target = tuple(
                slice(lo - a, hi - a)
                for lo, hi, a in zip(low, high, begin, strict=True)
            )
            yield i, block, source, target


def _file_problems(directory, index) -> list[str]:
    """Files the index names that are missing or shorter than it says."""
    ends: dict[str, int] = {}
    for entry in index["variables"].values():
        for block in entry["blocks"]:
            end = block["offset"] + block["nbytes"]
            ends[block["file"]] = max(ends.get(block["file"], 0), end)
    problems = []
    for name, end in sorted(ends.items()):
        path = directory / name
        if not path.exists():
            problems.append(f"{name}: missing (the index names it)")
        elif path.stat().st_size < end:
            problems.append(
                f"{name}: {path.stat().st_size} bytes, the index needs "
                f"{end} (truncated)"
            )
    return problems


def _problems(variables, index) -> list[str]:
    saved = index["variables"]
    problems = []
    for group in ("model", "optimizer"):
        ours = [k for k in variables if k.startswith(group + "/")]
        theirs = [k for k in saved if k.startswith(group + "/")]
        if ours and len(ours) != len(theirs):
            problems.append(
                f"the checkpoint holds {len(theirs)} {group} variables, the "
                f"model {len(ours)}"
            )
    for key, variable in variables.items():
        entry = saved.get(key)
        inner = getattr(variable, "_value", variable)
        dtype = tf.as_dtype(inner.dtype).name
        shape = [int(d) for d in variable.shape]
        name = f"{variable.path} ({key})"
        if entry is None:
            problems.append(f"{name}: not in the checkpoint")
        elif key.startswith("model/") and (
            entry["path"].rpartition("/")[2] != variable.name
        ):
            # Matched by position; a variable's own name does not carry
            # the auto-numbered names of its model or layers.
            problems.append(
                f"{name}: named {variable.name!r} in the model, "
                f"{entry['path'].rpartition('/')[2]!r} in the checkpoint "
                f"(as {entry['path']})"
            )
        elif entry["shape"] != shape:
            problems.append(
                f"{name}: shape {tuple(entry['shape'])} in the checkpoint "
                f"(as {entry['path']}), {tuple(shape)} in the model"
            )
        elif entry["dtype"] != dtype:
            problems.append(
                f"{name}: dtype {entry['dtype']} in the checkpoint (as "
                f"{entry['path']}), {dtype} in the model"
            )
        else:
            covered = sum(int(np.prod(b["shape"])) for b in entry["blocks"])
            if covered != int(np.prod(shape)):
                problems.append(
                    f"{name}: the checkpoint's blocks cover {covered} of "
                    f"{int(np.prod(shape))} elements"
                )
    return problems


def load(model, directory, *, verify=True) -> dict:
    """Loads a sharded checkpoint into `model`, on whatever mesh it has now.

    Every process calls it; each reads only the blocks it holds now. The
    optimizer is built first if the checkpoint holds optimizer state and it
    is not. Waits for this process's save in flight first.

    Args:
        model: A built Keras model: on one device, under a replicator,
            `DataParallel` or `ModelParallel` on any mesh.
        directory: A directory `save_checkpoint` wrote.
        verify: If True (the default), check each block's CRC-32 the first
            time it is read.

    Returns:
        The `metadata` dict the checkpoint was saved with.

    Raises:
        FileNotFoundError: If `directory` holds no committed checkpoint.
        ValueError: If the checkpoint does not match the model (a missing
            variable, a shape or dtype), before any weight changes; or a
            block is corrupt.
    """
    wait_for_saves()
    directory = pathlib.Path(directory)
    index = _read_index(directory)
    if index is None:
        raise FileNotFoundError(
            f"No sharded checkpoint in {directory} (no {INDEX}: none was "
            f"saved there, or none completed). Received: directory="
            f"{str(directory)!r}"
        )
    has_optimizer = any(k.startswith("optimizer/") for k in index["variables"])
    variables = _variables(model, build_optimizer=has_optimizer)
    if not has_optimizer:
        variables = {
            k: v for k, v in variables.items() if k.startswith("model/")
        }
    problems = _problems(variables, index) + _file_problems(directory, index)
    if problems:
        raise ValueError(
            "The sharded checkpoint does not match the model; no weight was "
            f"changed. Received: directory={str(directory)!r}, mismatches:\n  "
            + "\n  ".join(problems)
        )
    entries = index["variables"]
    plans = [
        _plan(variable, _Reader(directory, key, entries[key], verify))
        for key, variable in variables.items()
    ]
    if verify:
        # Every block this process reads is checked before any assignment,
        # so a corrupt block leaves the model as it was.
        for _, reader, boxes in plans:
            for begin, shape in boxes.values():
                reader.verify(begin, shape)
    for variable, reader, boxes in plans:
        if placements.of(variable) is None:
            ((begin, shape),) = boxes.values()
            variable.assign(reader.read(begin, shape))
            continue
        sharded.assign_blocks(
            variable,
            lambda r, rd=reader, b=boxes: rd.read(*b[r]),
        )
    return index["metadata"]


def _plan(variable, reader) -> tuple:
    """`(variable, reader, {replica: (begin, shape)})` this process reads."""
    placement = placements.of(variable)
    if placement is None:
        shape = tuple(int(d) for d in variable.shape)
        return variable, reader, {None: ([0] * len(shape), shape)}
    strategy = variable._value.distribute_strategy
    return (
        variable,
        reader,
        {
            r: (list(placement.begin(r)), placement.local_shape)
            for r in sharded.local_replicas(strategy)
        },
    )


def to_weights(model, directory, filepath) -> None:
    """Converts a sharded checkpoint to a whole Keras `.weights.h5` file.

    Loads the checkpoint into `model` (each process its blocks), then
    `model.save_weights(filepath)`, which under `ModelParallel` gathers and
    writes one variable at a time from the chief. Every process calls it.

    Args:
        model: A built model of the checkpoint's structure, on any mesh;
            compiled if the checkpoint holds optimizer state.
        directory: The sharded checkpoint.
        filepath: The `.weights.h5` file to write.

    Raises:
        ValueError: If `filepath` does not end in `.weights.h5`, or the
            checkpoint holds optimizer state and `model` has no optimizer
            (it would be dropped).
    """
    if not str(filepath).endswith(".weights.h5"):
        raise ValueError(
            "Keras writes weights to a file ending in `.weights.h5`. "
            f"Received: filepath={str(filepath)!r}"
        )
    index = _read_index(pathlib.Path(directory))
    holds_optimizer = index is not None and any(
        k.startswith("optimizer/") for k in index["variables"]
    )
    if holds_optimizer and getattr(model, "optimizer", None) is None:
        raise ValueError(
            "The checkpoint holds optimizer state and the model has no "
            "optimizer, so the state would be dropped: compile the model "
            f"first. Received: directory={str(directory)!r}"
        )
    load(model, directory)
    model.save_weights(filepath)


def from_weights(model, filepath, directory) -> None:
    """Converts a whole Keras `.weights.h5` file to a sharded checkpoint.

    `model.load_weights(filepath)` (each process cuts its blocks from the
    file's arrays, one variable at a time), then a synchronous `save`.
    Every process calls it.

    Args:
        model: A built model of the file's structure, on any mesh.
        filepath: A `.weights.h5` file.
        directory: The sharded checkpoint to write.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        # The file may hold the optimizer's state: give it somewhere to go.
        optimizer.build(model.trainable_variables)
    model.load_weights(filepath)
    save(model, directory, asynchronous=False)
