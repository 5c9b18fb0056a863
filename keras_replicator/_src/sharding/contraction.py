"""Products by a sharded kernel that move activations, not the kernel.

`sharded.gathered` gathers a sharded kernel whole on every replica (again in
the rematerialised backward pass) and all-reduces its full gradient before
cutting the block: for an (in, out) Dense kernel, three `in x out` transients
per replica and an all-reduce of as many. Here `ops.matmul(x, kernel)`,
`ops.matmul(x, ops.transpose(kernel))` (tied logits) and `ops.einsum(equation,
x, kernel)` (Dense, EinsumDense, keras-hub's attention and feed-forward layers)
by a sharded kernel are one op with its own gradient, taking one of two paths
by the step's rows. It chooses when traced if the batch shape is known (the
same on every replica, as Keras splits a global batch) or `batch_hint` gives
it, else in the graph (`tf.cond` on the gathered row counts, tracing both
paths):

- **Activations move** when the mesh's rows are no more bytes than the kernel
  (`N x rows x (row of x + row of y)` in the compute dtype, the kernel in its
  stored dtype: small batches). Every replica gathers all rows of `x` (`X`;
  only the columns its block contracts) and contracts them with its block;
  one all-to-all gives each replica its rows of every product, side by side
  (summed where the kernel splits the contraction). Where the kernel splits
  the output over all N replicas, a ring all-reduce of the whole output
  would send 2N times the bytes (less where blocks have copies). Backward,
  output gradients gather likewise (`dY`): each replica's block gradient
  comes from `X` and `dY`, rows weighted as the step's gradient rule weighs
  their replica's examples (`gradients.replica_weights`: the block is what
  `gradients.mean_gradients` makes of the full gradients), and the input
  gradient is exchanged as the output is. No full kernel or kernel gradient
  exists anywhere.
- **The kernel moves** otherwise: gathered for the product and again in the
  backward pass (no rematerialisation needed), its full gradient averaged
  and cut to the block, as `sharded.gathered` does.

An embedding lookup (`ops.take(table, ids, axis=0)`) of a sharded table
always moves rows (`lookup`): the ids are far fewer values than the table.

Each output element is one device's contraction, up to the order of float
sums. Taken only for a dense `x` whose first dimension is the batch and whose
trailing dimensions match on every replica, in a traced step, in float32,
float64, bfloat16 or float16 (others move the kernel); anything else is left
to the stock op and `sharded.gathered`. A 16-bit product whose contraction
the kernel splits is summed in float32 and rounded once, as one device's
single product is; disjoint blocks are put side by side in 16 bits, exactly.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import tensorflow as tf

from keras_replicator._src import collectives
from keras_replicator._src import gradients
from keras_replicator._src.core import placements
from keras_replicator._src.sharding import sharded
from keras_replicator._src.upstream import record

# Names the check (`_Rows`) that fails where replicas' rows have other
# trailing dimensions: the error shows it.
_OTHER_TRAILING_DIMENSIONS = (
    "ModelParallel_rows_of_other_trailing_dimensions_on_another_replica_"
    "pad_every_replicas_batches_to_one_shape"
)

# Compute dtypes whose activations can move (16-bit ones `widened`).
_MOVING_DTYPES = frozenset({tf.float16, tf.bfloat16, tf.float32, tf.float64})


class Transposed:
    """`ops.transpose(kernel)` of a sharded 2-D kernel, not yet gathered.

    `matmul` takes it for tied logits (`ops.matmul(x, ops.transpose(t))`);
    anything else converts it to the gathered table, transposed.
    """

    def __init__(self, variable: Any):
        self.variable = variable

    @property
    def shape(self):
        return tf.TensorShape(self.variable.shape[::-1])

    @property
    def ndim(self):
        return 2

    @property
    def dtype(self):
        return read_dtype(self.variable)

    def tensor(self):
        return tf.transpose(tf.convert_to_tensor(self.variable))

    def __tf_tensor__(self, dtype=None, name=None):
        return tf.convert_to_tensor(self.tensor(), dtype=dtype, name=name)

    def __array__(self, dtype=None):
        return np.asarray(self.tensor(), dtype=dtype)


def _binary(name):
    def op(self, other):
        return getattr(self.tensor(), name)(other)

    op.__name__ = name
    return op


for _name in (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
    "__truediv__", "__rtruediv__", "__matmul__", "__rmatmul__",
    "__getitem__",
):  # fmt: skip
    setattr(Transposed, _name, _binary(_name))


def in_step(variable: Any):
    """The replica context if `variable` is sharded and read in its step."""
    if (
        placements.of(variable) is None
        or getattr(variable, "_value", None) is None
        or placements.reading_locally()
        or tf.executing_eagerly()
    ):
        return None
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.strategy is not variable._value.distribute_strategy:
        return None
    return ctx


def parse(equation: str, kernel_rank: int) -> tuple | None:
    """`(x, kernel, output)` labels of a contraction this module takes.

    None unless `equation` contracts `x` with a rank-`kernel_rank` kernel as
    a dense layer does, `x`'s first dimension a batch one: each label once
    per operand, a kernel label in `x` or in the output but not both, an `x`
    label not in the kernel in the output, no ellipsis.
    """
    if not isinstance(equation, str) or "..." in equation:
        return None
    if "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    if inputs.count(",") != 1:
        return None
    x_labels, k_labels = inputs.split(",")
    if any(len(set(s)) != len(s) for s in (x_labels, k_labels, out)):
        return None
    if (
        len(k_labels) != kernel_rank
        or not x_labels
        or out[:1] != x_labels[:1]
        or x_labels[0] in k_labels
    ):
        return None
    for label in k_labels:
        if (label in x_labels) == (label in out):
            return None
    for label in x_labels:
        if label not in k_labels and label not in out:
            return None
    for label in out:
        if label not in x_labels and label not in k_labels:
            return None
    return x_labels, k_labels, out


def labels(equation: str, x: Any, variable: Any) -> tuple | None:
    """`parse`'s labels if `x` fits them and the kernel's read dtype."""
    found = parse(equation, len(variable.shape))
    if found is None or not tf.is_tensor(x) or isinstance(x, tf.SparseTensor):
        return None
    x_labels, k_labels, _ = found
    if x.shape.rank != len(x_labels) or x.dtype != read_dtype(variable):
        return None
    for label, size in zip(k_labels, variable.shape, strict=True):
        if label in x_labels:
            dim = x.shape[x_labels.index(label)]
            if dim is not None and dim != size:
                return None
    return found


def read_dtype(variable) -> tf.DType:
    """The dtype an op sees when it reads `variable` (autocast applied)."""
    probe = tf.zeros([], variable._value.dtype)
    return tf.as_dtype(variable._maybe_autocast(probe).dtype)


class _Rows:
    """The mesh's rows in a replica step: gathered, exchanged and summed.

    Rows are gathered in replica order, zero-padded to the most any replica
    has (`most`); where a replica needs only its block of columns, or its own
    rows of a result, one all-to-all exchanges just that. Made once per op,
    forward: one gather carries every replica's row count, gradient weight
    and values per row (none if `exchange` is false: the kernel moves). Rows
    travel as equal flat pieces, so other trailing dimensions on one replica
    (a custom loop's padding) fail on every replica rather than misplace.

    Each op a product adds is graph the process holds (about 11 KB of RSS a
    node, `benchmarks/RESULTS.md`), once per replica: shapes known when
    traced stay constants, a tensor is cut into the replicas' blocks by one
    `Split` per axis and an all-to-all's result unstacked once, and what
    only a backward pass reads is made there.
    """

    def __init__(self, ctx, placement, rows, row_size, exchange=True):
        self.ctx = ctx
        self.replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
        self.replicas = ctx.num_replicas_in_sync
        # The first replica holding each distinct block, in replica order.
        self.primaries = [
            r for r in range(self.replicas) if _primary(placement, r)
        ]
        self.rows = rows
        self.weight = gradients.replica_weights(ctx, tf.float32)
        if not exchange:
            return
        row_size = tf.cast(row_size, tf.float32)
        meta = collectives.all_gather_equal(
            ctx, tf.stack([tf.cast(rows, tf.float32), self.weight, row_size])
        )
        counts, weights, sizes = tf.unstack(
            tf.reshape(meta, [self.replicas, 3]), axis=1
        )
        self._weights = weights
        # Not `tf.debugging.assert_*`: `tf.function` runs stateful ops
        # without a resource input (an `Assert`) in traced order across
        # replicas, so replica 1's check would wait for ops replica 0 traced
        # after its gathers, which wait for replica 1's: a deadlock.
        # `EnsureShape` is stateless; its input, named for the error, has one
        # value where any replica's rows differ.
        differ = tf.reduce_any(tf.not_equal(sizes, row_size))
        check = tf.ensure_shape(
            tf.fill(
                tf.reshape(tf.cast(differ, tf.int32), [1]),
                0.0,
                name=_OTHER_TRAILING_DIMENSIONS,
            ),
            [0],
        )
        # Read (an empty sum: 0), so the rows wait for it.
        self.counts = tf.cast(counts + tf.reduce_sum(check), tf.int32)
        # At least one row: TensorFlow's CPU all-to-all fails on no values.
        self.most = tf.maximum(tf.reduce_max(self.counts), 1)
        self._padding = self.most - rows

    def row_weights(self):
        """Per gathered row: its replica's gradient weight."""
        grid = tf.broadcast_to(
            self._weights[:, None], tf.stack([self.replicas, self.most])
        )
        return tf.reshape(grid, [-1])

    def valid(self):
        """Per gathered row: whether it is a row, not padding."""
        grid = tf.range(self.most)[None, :] < self.counts[:, None]
        return tf.reshape(grid, [-1])

    def _padded(self, t):
        """`t` (this replica's rows) padded with zeros to `most` rows."""
        padding = [[0, self._padding]] + [[0, 0]] * (t.shape.rank - 1)
        return tf.pad(t, padding)

    def gather(self, t):
        """Every replica's rows of `t`, each padded with zeros to `most`."""
        flat = collectives.all_gather_equal(
            self.ctx, tf.reshape(self._padded(t), [-1])
        )
        return tf.reshape(flat, _shape([-1], t.shape[1:], t, 1))

    def gather_cut(self, t, slices):
        """This replica's block of `self.gather(t)`, each replica sent its cut.

        `slices(r)`: `(axis, begin, size, full)` of replica `r`'s block of
        `t`'s columns. One all-to-all: 1/N of what a gather moves.
        """
        pieces = tf.stack(_blocks(self._padded(t), slices, self.replicas))
        got = collectives.all_to_all_equal(self.ctx, pieces)
        merged = tf.reshape(got, _shape([-1], got.shape[2:], got, 2))
        merged.set_shape([None, *got.shape[2:]])
        return merged

    def per_row(self, values, t):
        """`values` (one per gathered row) shaped to broadcast over `t`."""
        return tf.reshape(values, [-1] + [1] * (t.shape.rank - 1))

    def summed_own(self, part, slices):
        """This replica's rows of the replicas' parts, placed and summed.

        `part`: this replica's product over the `N x most` gathered rows;
        `slices(r)`: `(axis, begin, size, full)` of replica `r`'s part. After
        one all-to-all each distinct block is placed once: side by side if
        they tile the output, else summed in replica order in `part`'s dtype.
        """
        pieces = tf.reshape(
            part, _shape([self.replicas, -1], part.shape[1:], part, 1)
        )
        pieces.set_shape([self.replicas, None, *part.shape[1:]])
        got = tf.unstack(
            collectives.all_to_all_equal(self.ctx, pieces), self.replicas
        )
        split = {
            r: [s for s in slices(r) if s[2] != s[3]] for r in self.primaries
        }
        axes = {axis for found in split.values() for axis, *_ in found}
        begins = [found[0][1] for found in split.values() if found]
        if len(axes) == 1 and len(set(begins)) == len(self.primaries):
            # Disjoint blocks along one axis: side by side, no sum.
            (axis,) = axes
            order = sorted(self.primaries, key=lambda r: split[r][0][1])
            whole = tf.concat([got[r] for r in order], axis)
        else:
            placed = []
            for r in self.primaries:
                padding = [[0, 0]] * part.shape.rank
                for axis, start, size, full in split[r]:
                    padding[axis] = [start, full - start - size]
                placed.append(tf.pad(got[r], padding) if split[r] else got[r])
            whole = tf.add_n(placed)
        return whole[: self.rows]

    def weighted(self, t):
        """`t`'s gathered rows times their replica's weight (16-bit: in f32)."""
        wire = _wire(t.dtype)
        weights = tf.cast(self.per_row(self.row_weights(), t), wire)
        return tf.cast(tf.cast(t, wire) * weights, t.dtype)


def _shape(lead, trailing, t, start):
    """`lead` then `trailing` dimensions: constants where known when traced.

    `trailing` are `t`'s static dimensions from `start`; where one is
    unknown, they are read from `tf.shape(t)` in the graph.
    """
    if trailing.is_fully_defined():
        return [*lead, *trailing.as_list()]
    return tf.concat([lead, tf.shape(t)[start:]], 0)


def _blocks(t, slices, replicas) -> list:
    """Every replica's block of `t`: `slices(r)` as in `_Rows.gather_cut`.

    Blocks tile each split axis in equal parts, so one `Split` per axis (and
    per block of the axes before it) cuts them all, not a slice a replica.
    """
    found = {(): t}
    splits = {}
    out = []
    for r in range(replicas):
        key = ()
        for axis, start, size, whole in slices(r):
            if size == whole:
                continue
            parent, key = key, (*key, (axis, start))
            if key not in found:
                if (parent, axis) not in splits:
                    splits[parent, axis] = tf.split(
                        found[parent], whole // size, axis
                    )
                found[key] = splits[parent, axis][start // size]
        out.append(found[key])
    return out


def contract(
    equation: str, x: tf.Tensor, variable: Any, ctx, product=None, bias=None
) -> tf.Tensor:
    """`einsum(equation, x, variable)` for a sharded `variable`, in its step.

    `equation` must pass `labels`. `product(x, kernel)` is the op one device
    runs (Keras' `matmul` or `einsum`; default `tf.einsum`), used for the
    blocks and their gradients: outputs and weight-gradient blocks are one
    device's to the bit where the op computes a block of columns as in the
    whole (`tf.matmul` on the CPU does; `tf.einsum` does not).

    `bias` (a tensor of the output's trailing dimensions, in `x`'s dtype)
    is added as `Dense` adds it, but to each block's product before the
    blocks are exchanged where the kernel leaves the contraction whole: one
    device's graph has the product and its add side by side, and TensorFlow
    2.22's grappler fuses them into one oneDNN matmul that starts its sums
    from the bias, which rounds otherwise than adding it after (in about
    95% of elements). Here the block's product and add fuse alike.
    """
    if product is None:

        def product(a, b):
            return tf.einsum(equation, a, b)

    x_labels, k_labels, out_labels = labels(equation, x, variable)
    placement = placements.of(variable)
    replicas = ctx.num_replicas_in_sync
    local = placement.local_shape
    full = placement.full_shape
    # The stored block; the op casts it to the compute dtype (autocast), and
    # its gradient is reduced in the stored dtype, as one device's is.
    stored = tf.convert_to_tensor(variable._value)
    dtype = x.dtype
    # What one device's einsum would know of the output's shape.
    y_static = [
        x.shape[x_labels.index(label)]
        if label in x_labels
        else full[k_labels.index(label)]
        for label in out_labels
    ]

    if dtype in _MOVING_DTYPES and stored.dtype.is_floating:
        contracted = math.prod(
            n
            for n, label in zip(full, k_labels, strict=True)
            if label in x_labels
        )
        free = math.prod(
            n
            for n, label in zip(full, k_labels, strict=True)
            if label in out_labels
        )
        # Bytes: under mixed precision rows are 16-bit, the kernel float32.
        kernel_bytes = math.prod(full) * stored.dtype.size
        rows = x.shape[0]
        if rows is None and x.shape[1:].is_fully_defined():
            rows = _hinted_rows(ctx)
        if rows is not None and x.shape[1:].is_fully_defined():
            # Known when traced, the same on every replica: no `tf.cond`.
            x_row = math.prod(x.shape[1:])
            moving = (
                replicas
                * rows
                * (x_row + x_row // contracted * free)
                * dtype.size
                <= kernel_bytes
            )
        else:
            moving = None  # Decided in the graph, from the row counts.
    else:
        moving = False
    # Where the kernel moves (chosen when traced), no row counts gather.
    if x.shape[1:].is_fully_defined():
        row_size = math.prod(x.shape[1:])
    else:
        row_size = tf.reduce_prod(tf.shape(x)[1:])
    mesh = _Rows(
        ctx, placement, tf.shape(x)[0], row_size, exchange=moving is not False
    )
    if moving is None:
        x_row = tf.cast(row_size, tf.float64)
        y_row = x_row / contracted * free
        moving = tf.cast(replicas * mesh.most, tf.float64) * (
            x_row + y_row
        ) * dtype.size <= float(kernel_bytes)
    begin = placement.begin(mesh.replica)
    bias_labels = _bias_labels(bias, out_labels, y_static)

    def slices(axis_labels, replica=None):
        """`(axis, begin, size, full)` per kernel axis of `replica`'s block."""
        start = begin if replica is None else placement.begin(replica)
        out = []
        for axis, label in enumerate(axis_labels):
            if label in k_labels:
                d = k_labels.index(label)
                out.append((axis, start[d], local[d], full[d]))
        return out

    def cut(t, axis_labels):
        for axis, start, size, whole in slices(axis_labels):
            if size != whole:
                t = _slice(t, axis, start, size)
        return t

    def rows_of_all(t, axis_labels):
        """Every replica's rows of `t`, cut to this replica's block."""
        if not split(axis_labels):
            return mesh.gather(t)
        return mesh.gather_cut(t, lambda r: slices(axis_labels, r))

    def summed(part, axis_labels):
        """This replica's rows of the replicas' parts, summed."""
        return mesh.summed_own(part, lambda r: slices(axis_labels, r))

    def gathered_kernel(raw):
        return tf.cast(sharded.all_blocks(ctx, raw, placement), dtype)

    def split(axis_labels):
        return any(size != whole for _, _, size, whole in slices(axis_labels))

    wide = _wire(dtype)

    def widened(along, *tensors):
        """`tensors` in float32 if 16-bit and the kernel splits `along`."""
        if wide != dtype and split(along):
            return [tf.cast(t, wide) for t in tensors]
        return list(tensors)

    @tf.custom_gradient
    def op(x, raw, *biases):
        block = tf.cast(raw, dtype)

        def moving_forward():
            x_in = rows_of_all(x, x_labels)
            part = product(*widened(x_labels, x_in, block))
            if biases and not split(x_labels):
                part += cut(biases[0], bias_labels)
            y = tf.cast(summed(part, out_labels), dtype)
            return y + biases[0] if biases and split(x_labels) else y

        def kernel_forward():
            y = product(x, gathered_kernel(raw))
            return y + biases[0] if biases else y

        y = _choose(moving, moving_forward, kernel_forward)
        y.set_shape(y_static)

        def grad(dy):
            d_biases = [_bias_gradient(dy, b) for b in biases]

            def moving_backward():
                x_in = rows_of_all(x, x_labels)
                dy_all = rows_of_all(dy, out_labels)
                # d_block contracts all the rows, as on one device.
                _, d_block = _gradients(
                    product, x_in, block, mesh.weighted(dy_all)
                )
                if not needs_dx:
                    # `x`'s gradient is never read (input data): skip its
                    # product and sum (a collective always runs), as one
                    # device prunes an unused gradient.
                    return tf.zeros_like(x), tf.cast(d_block, raw.dtype)
                dx_part, _ = _gradients(
                    product, *widened(out_labels, x_in, block, dy_all)
                )
                dx = summed(dx_part, x_labels)
                return tf.cast(dx, dtype), tf.cast(d_block, raw.dtype)

            def kernel_backward():
                dx, d_kernel = _gradients(product, x, gathered_kernel(raw), dy)
                # `gradients.mean_gradients`' average in one collective (it
                # may sit in a `tf.cond` branch); a 16-bit kernel's in float32.
                wire = _wire(raw.dtype)
                d_kernel = tf.cast(d_kernel, wire)
                own_weight = tf.cast(mesh.weight, wire)
                reduced = collectives.all_reduce_sum(ctx, d_kernel * own_weight)
                block = placement.block(reduced, mesh.replica)
                return dx, tf.cast(block, raw.dtype)

            dx, d_raw = _choose(moving, moving_backward, kernel_backward)
            dx.set_shape(x.shape)
            d_raw.set_shape(raw.shape)
            return (dx, d_raw, *d_biases)

        return y, grad

    # False for a model's input data under a tape (Keras' steps, custom
    # loops), which records only what depends on what it watches. With no
    # tape, `tf.gradients` may differentiate the graph: keep every gradient.
    needs_dx = not record.could_possibly_record() or (
        record.should_record_backprop([x])
    )
    if bias_labels is None:
        y = op(x, stored)
        return y if bias is None else y + bias
    return op(x, stored, bias)


def _bias_labels(bias, out_labels, y_static) -> str | None:
    """The output labels `bias` spans if it adds inside the op, else None.

    Where a dimension of it broadcasts, or the output's is unknown, it adds
    after, as `Dense`'s `ops.add` would.
    """
    if bias is None or not 0 < bias.shape.rank <= len(out_labels):
        return None
    trailing = y_static[len(out_labels) - bias.shape.rank :]
    if None in trailing or list(bias.shape) != trailing:
        return None
    return out_labels[len(out_labels) - bias.shape.rank :]


def _bias_gradient(dy, bias):
    """`bias`'s gradient from `dy`, as `AddV2`'s: summed over what it spans."""
    leading = list(range(dy.shape.rank - bias.shape.rank))
    return tf.reshape(tf.reduce_sum(dy, leading), tf.shape(bias))


def lookup(variable: Any, ids: Any, ctx) -> tf.Tensor | None:
    """`ops.take(variable, ids, axis=0)` for a sharded 2-D table, or None.

    Each replica looks up the gathered ids its block holds; one all-to-all
    gives each its rows of every lookup, summed (one nonzero per element:
    exact). The gradient is sparse, as one device's: this block's rows of
    every output gradient, weighted as `mean_gradients` weighs their replica,
    with their ids (repeats kept). An id outside the table reads zeros (one
    device's CPU lookup fails). None (read the table whole) unless `ids` is
    a dense integer tensor of rank 1 or more.
    """
    placement = placements.of(variable)
    if len(placement.full_shape) != 2:
        return None
    if not tf.is_tensor(ids) or isinstance(
        ids, (tf.SparseTensor, tf.RaggedTensor)
    ):
        return None
    if not ids.dtype.is_integer or ids.shape.rank in (None, 0):
        return None
    dtype = read_dtype(variable)
    if not dtype.is_floating:
        return None
    vocabulary, _ = placement.full_shape
    mesh = _Rows(
        ctx, placement, tf.shape(ids)[0], tf.reduce_prod(tf.shape(ids)[1:])
    )
    v_begin, _ = placement.begin(mesh.replica)
    v_local, h_local = placement.local_shape
    hidden = placement.full_shape[1]
    # Keras' `take`: a negative id counts from the end.
    ids = tf.where(ids < 0, ids + tf.cast(vocabulary, ids.dtype), ids)
    stored = tf.convert_to_tensor(variable._value)
    ids_all = mesh.gather(ids)
    inside = tf.logical_and(ids_all >= v_begin, ids_all < v_begin + v_local)
    local_ids = tf.where(inside, ids_all - v_begin, tf.zeros_like(ids_all))

    @tf.custom_gradient
    def op(raw):
        found = tf.gather(tf.cast(raw, dtype), local_ids)
        part = tf.where(inside[..., None], found, tf.zeros_like(found))
        last = part.shape.rank - 1
        y = mesh.summed_own(
            part,
            lambda r: [(last, placement.begin(r)[1], h_local, hidden)],
        )
        y.set_shape(ids.shape.concatenate([hidden]))

        def grad(dy):
            if h_local == hidden:
                dy_all = mesh.gather(dy)
            else:
                dy_all = mesh.gather_cut(
                    dy,
                    lambda r: [(last, placement.begin(r)[1], h_local, hidden)],
                )
            keep = tf.logical_and(inside, mesh.per_row(mesh.valid(), inside))
            keep = tf.reshape(keep, [-1])
            values = tf.boolean_mask(
                tf.reshape(mesh.weighted(dy_all), [-1, h_local]), keep
            )
            indices = tf.boolean_mask(tf.reshape(local_ids, [-1]), keep)
            return tf.IndexedSlices(
                tf.cast(values, raw.dtype),
                tf.cast(indices, tf.int64),
                tf.constant(placement.local_shape, tf.int64),
            )

        return y, grad

    return op(stored)


# Set on a strategy while a Keras loop over array data runs: its global
# batch size (`batch_hint`).
_BATCH_ATTR = "_keras_replicator_global_batch"


@contextlib.contextmanager
def batch_hint(strategy, global_batch: int | None):
    """Products traced meanwhile take the path a full batch's rows pick.

    Keras knows array data's `batch_size`, but its traced step has a None
    batch dimension (the last batch may be smaller, and takes the same path,
    as exactly). With the hint, a product whose other dimensions are known
    chooses when traced, from `ceil(global_batch / replicas)` rows; every
    process gets the same `batch_size`, so every replica takes the same path.
    """
    previous = getattr(strategy, _BATCH_ATTR, None)
    setattr(strategy, _BATCH_ATTR, global_batch)
    try:
        yield
    finally:
        setattr(strategy, _BATCH_ATTR, previous)


def _hinted_rows(ctx) -> int | None:
    global_batch = getattr(ctx.strategy, _BATCH_ATTR, None)
    if not global_batch:
        return None
    return -(-global_batch // ctx.num_replicas_in_sync)


def _gradients(product, a, b, upstream):
    """The gradients of `product(a, b)` for `upstream`, as autodiff makes them.

    The ops one device's backward pass runs (`MatMul`'s gradient for a
    matmul); the recomputed product itself is unused, and pruned.
    """
    with tf.GradientTape() as tape:
        tape.watch([a, b])
        out = product(a, b)
    return tape.gradient(out, [a, b], output_gradients=upstream)


def _wire(dtype: tf.DType) -> tf.DType:
    """The dtype sums and weights of `dtype` values are carried in."""
    return tf.float32 if dtype.size < 4 else dtype


def _choose(moving, moving_fn, kernel_fn):
    """The path `moving` picks: a Python bool when traced, else in graph."""
    if isinstance(moving, bool):
        return moving_fn() if moving else kernel_fn()
    return tf.cond(moving, moving_fn, kernel_fn)


def _slice(t, axis, start, size):
    index = [slice(None)] * t.shape.rank
    index[axis] = slice(start, start + size)
    return t[tuple(index)]


def _primary(placement, replica: int) -> bool:
    """Whether `replica` is the first of the replicas holding its block."""
    coords = np.unravel_index(replica, placement.mesh_shape)
    used = {a for a in placement.dim_axes if a is not None}
    return all(int(c) == 0 for i, c in enumerate(coords) if i not in used)


def matmul_equation(x: Any, transposed: bool) -> str | None:
    """The einsum of `x @ kernel` (or `x @ kernel.T`) for a 2-D kernel."""
    rank = getattr(getattr(x, "shape", None), "rank", None)
    if rank is None or rank < 2 or rank > 20:
        return None
    lead = "abcdefghijklmnopqrst"[: rank - 1]
    return f"{lead}y,{'zy' if transposed else 'yz'}->{lead}z"
