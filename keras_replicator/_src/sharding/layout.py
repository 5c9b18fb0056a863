"""Where each slice of a laid-out variable lives: pure arithmetic on a mesh.

A Keras `TensorLayout` names, per dimension of a variable, the mesh axis it
is split over (or None). On a `(2, 4)` mesh with axes `("batch", "model")`, a
`(784, 200)` kernel laid out `(None, "model")` is cut into 4 `(784, 50)`
column blocks; the device at mesh coordinates `(b, m)` holds block `m`, so
each block lives on the 2 devices that differ only along `"batch"`.

Devices are numbered in the mesh's flat (row-major) order, the replica order
of the replicator that runs the mesh (`runtime.py`): replica `r` holds the
block at `numpy.unravel_index(r, mesh.shape)`.
"""

from __future__ import annotations

import dataclasses
import math
import mmap

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one variable is split over the devices of a mesh.

    `dim_axes[d]`: the index of the mesh axis dimension `d` is split over, or
    None. `devices`: the mesh's device names in flat (replica) order. `path`
    is for messages.
    """

    path: str
    full_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    dim_axes: tuple[int | None, ...]
    devices: tuple[str, ...]

    @property
    def sharded(self) -> bool:
        """Whether any dimension is split."""
        return any(a is not None for a in self.dim_axes)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the block each device holds."""
        return tuple(
            d if a is None else d // self.mesh_shape[a]
            for d, a in zip(self.full_shape, self.dim_axes, strict=True)
        )

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def copies(self) -> int:
        """On how many devices each block lives (the unused axes' sizes)."""
        used = {a for a in self.dim_axes if a is not None}
        return math.prod(
            n for i, n in enumerate(self.mesh_shape) if i not in used
        )

    def begin(self, replica: int) -> tuple[int, ...]:
        """The offset of replica `replica`'s block in the full variable."""
        coords = np.unravel_index(replica, self.mesh_shape)
        return tuple(
            0 if a is None else int(coords[a]) * local
            for a, local in zip(self.dim_axes, self.local_shape, strict=True)
        )

    def block(self, full, replica: int):
        """Replica `replica`'s block of `full`: an array, dataset or tensor.

        A NumPy array gives a view, an h5py dataset reads the block only, a
        file's memory map (`sharded.mapped_dataset`) gives a copy
        (`_copy_from_map`).
        """
        begin = self.begin(replica)
        if not tf.is_tensor(full) and not isinstance(full, tf.Variable):
            index = tuple(
                slice(b, b + n)
                for b, n in zip(begin, self.local_shape, strict=True)
            )
            if isinstance(full, np.memmap) and index:
                return _copy_from_map(full, index)
            return full[index]
        return tf.slice(full, begin, self.local_shape)

    def assemble(self, blocks: tf.Tensor) -> tf.Tensor:
        """The full variable from `blocks`, every replica's, in replica order.

        `blocks` has shape `(num_devices, *local_shape)`, as an all-gather's.
        """
        rank = len(self.full_shape)
        grid = tf.reshape(blocks, [*self.mesh_shape, *self.local_shape])
        # One copy of each block: index 0 along the mesh axes not used.
        used = [a for a in self.dim_axes if a is not None]
        begin = [0] * (len(self.mesh_shape) + rank)
        size = [
            n if i in used else 1 for i, n in enumerate(self.mesh_shape)
        ] + list(self.local_shape)
        grid = tf.slice(grid, begin, size)
        # Interleave: tensor dimension d becomes (mesh axis of d, local d).
        order = []
        mesh_rank = len(self.mesh_shape)
        for d, a in enumerate(self.dim_axes):
            if a is not None:
                order.append(a)
            order.append(mesh_rank + d)
        unused = [i for i in range(mesh_rank) if i not in used]
        grid = tf.transpose(grid, unused + order)
        return tf.reshape(grid, self.full_shape)


def _describe(path, shape, axes, mesh) -> str:
    return (
        f"Received: variable path={path!r}, shape={tuple(shape)}, "
        f"layout={tuple(axes)}, mesh shape={tuple(mesh.shape)} with axes "
        f"{tuple(mesh.axis_names)}"
    )


def placement(path: str, shape, layout, mesh) -> Placement:
    """The `Placement` of `layout` (a `TensorLayout` or axes) on `mesh`.

    Raises:
        ValueError: If the layout has more entries than the variable has
            dimensions, names an axis the mesh lacks or one axis twice, or
            splits a dimension by an axis size that does not divide it.
        NotImplementedError: If a dimension is split over several mesh axes.
    """
    axes = tuple(getattr(layout, "axes", layout))
    shape = tuple(int(d) for d in shape)
    names = tuple(mesh.axis_names)
    if len(axes) > len(shape):
        raise ValueError(
            f"A layout names at most one mesh axis (or None) per dimension "
            f"of the variable: the layout has {len(axes)} entries and the "
            f"variable {len(shape)} dimensions. "
            + _describe(path, shape, axes, mesh)
        )
    # As JAX reads a short `PartitionSpec`: unnamed dimensions stay whole
    # (`("model",)` splits a 2-D variable's rows only).
    axes = axes + (None,) * (len(shape) - len(axes))
    dim_axes = []
    for axis in axes:
        if axis is None:
            dim_axes.append(None)
            continue
        if isinstance(axis, (tuple, list)):
            raise NotImplementedError(
                "keras-replicator splits a dimension over one mesh axis; a "
                "dimension over several axes at once is not supported. "
                + _describe(path, shape, axes, mesh)
            )
        if axis not in names:
            raise ValueError(
                f"Layout axis {axis!r} is not an axis of the mesh; the mesh "
                f"has axes {names}. " + _describe(path, shape, axes, mesh)
            )
        index = names.index(axis)
        if index in dim_axes:
            raise ValueError(
                f"Layout axis {axis!r} splits two dimensions; each mesh axis "
                "may split one. " + _describe(path, shape, axes, mesh)
            )
        dim_axes.append(index)
    for d, a in zip(shape, dim_axes, strict=True):
        if a is not None and d % mesh.shape[a]:
            raise ValueError(
                f"Mesh axis {names[a]!r} has {mesh.shape[a]} devices, which "
                f"does not divide the dimension of size {d} it splits. "
                + _describe(path, shape, axes, mesh)
            )
    return Placement(
        path=path,
        full_shape=shape,
        mesh_shape=tuple(int(n) for n in mesh.shape),
        axis_names=names,
        dim_axes=tuple(dim_axes),
        devices=tuple(str(d) for d in np.asarray(mesh.devices).reshape(-1)),
    )


# Rows of a mapped file copied between two releases of their pages.
_MAP_CHUNK_BYTES = 8 << 20


def _copy_from_map(full: np.memmap, index: tuple[slice, ...]) -> np.ndarray:
    """A block of a file's memory map, copied; the file's pages let go.

    A block that splits rows (a table cut along its hidden size) touches every
    page of the rows it spans, which would stay resident (and count in this
    process's memory) until the map closes. So it is copied a few MiB of rows
    at a time, releasing their pages with `madvise(MADV_DONTNEED)`: a
    read-only file map rereads them from the file if touched.
    """
    view = full[index]
    out = np.empty(view.shape, view.dtype)
    mapping = getattr(full, "_mmap", None)
    advise = getattr(mapping, "madvise", None)
    dontneed = getattr(mmap, "MADV_DONTNEED", None)
    if (
        advise is None
        or dontneed is None
        or full.ndim == 0
        or not full.flags.c_contiguous
    ):
        out[...] = view
        return out
    row_bytes = full.strides[0]
    rows = max(1, _MAP_CHUNK_BYTES // max(row_bytes, 1))
    # Where the array's first byte is in the mapping (np.memmap maps from
    # its offset rounded down to the allocation granularity).
    lead = full.ctypes.data - np.frombuffer(mapping, np.uint8, 1).ctypes.data
    first = index[0].start or 0
    for start in range(0, view.shape[0], rows):
        stop = min(start + rows, view.shape[0])
        out[start:stop] = view[start:stop]
        begin = lead + (first + start) * row_bytes
        end = lead + (first + stop) * row_bytes
        begin -= begin % mmap.PAGESIZE
        end = min(-(-end // mmap.PAGESIZE) * mmap.PAGESIZE, len(mapping))
        if end > begin:
            advise(dontneed, begin, end - begin)
    return out
