"""A sharded checkpoint's files: the format, the writer and the reader.

The index's format and version, a process's `process-<k>.bin` and part of
the index, each block's CRC-32, and the reader that memory-maps the blocks a
box needs (`checkpoint.py` says why files of our own). Nothing here talks to
another process (`checkpoint_commit.py` does).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import pathlib
import zlib

import numpy as np
import tensorflow as tf

FORMAT = "keras-replicator-sharded-checkpoint"

VERSION = 1

INDEX = "index.json"

_CRC_CHUNK = 1 << 24  # bytes per checksum update: a bounded transient


def checksum(array, stop=None) -> int:
    flat = np.asarray(array, order="C").reshape(-1).view(np.uint8)
    crc = 0
    for start in range(0, flat.size, _CRC_CHUNK):
        check(stop)
        crc = zlib.crc32(flat[start : start + _CRC_CHUNK], crc)
    return crc


class DirectFile:
    """Writes a file's bytes in order past the page cache (`O_DIRECT`).

    Through the page cache, the kernel's page copies for a background save's
    hundreds of MB slowed the training steps beside it by several times the
    writer's own CPU (benchmarks/RESULTS.md, "Backups"). Without `O_DIRECT`
    (macOS, tmpfs on older kernels) the same calls use the page cache; the
    file is the same.
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
                check(self._stop)
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


class Abandoned(Exception):
    """The save was abandoned (`CheckpointSave._abandon`)."""


def check(stop) -> None:
    if stop is not None and stop.is_set():
        raise Abandoned()


def part_files(folder, process) -> tuple:
    """Process k's data, its part of the index, and that part's draft."""
    return tuple(
        folder / f"process-{process}{suffix}"
        for suffix in (".bin", ".json", ".json.tmp")
    )


def write_part(folder, process, parts, stop=None) -> None:
    """Writes `process-<k>.bin` and `process-<k>.json`, synced."""
    data, part, temporary = part_files(folder, process)
    manifest = {}
    offset = 0
    f = DirectFile(data, stop)
    try:
        for key, (entry, blocks) in parts.items():
            written = []
            for i, (begin, array) in enumerate(blocks):
                # Let go once written: a buffer no snapshot holds updates in
                # place, without TensorFlow's copy-on-write (`_snapshot`).
                blocks[i] = (begin, None)
                check(stop)
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
                        "crc32": checksum(raw, stop),
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


def sync_folder(folder) -> None:
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


def read_index(directory) -> dict | None:
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


def numpy_dtype(name: str):
    return tf.as_dtype(name).as_numpy_dtype


class Reader:
    """Reads any box of one variable from the blocks that intersect it."""

    def __init__(self, directory, key, entry, verify):
        self._directory = directory
        self._key = key
        self._entry = entry
        self._dtype = numpy_dtype(entry["dtype"])
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
            if checksum(mapped) != block["crc32"]:
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


def file_problems(directory, index) -> list[str]:
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
