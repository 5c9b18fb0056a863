"""Collectives between processes over MPI: the MaTEx paper's transport.

`MultiWorkerReplicator` (so `keras.distribution` over processes too) issues
every collective of a step (gradient all-reduces, Keras' logs,
`strategy.reduce`, ModelParallel's gathers, sums and all-to-alls) through
its cross-device ops' per-replica launchers; `collectives.py` calls them
too. Under the MPI transport (cluster/transport.py) `install` swaps them
for `MpiLauncher`s: the same graph moves its bytes with mpi4py instead of
TensorFlow's gRPC ring. Start-up, the chief's broadcast of initial values,
heartbeats and barriers stay on TensorFlow's coordination service (once
per job or save, not per step).

Each collective is one stateful `tf.numpy_function`. MPI matches
collectives by order alone (TensorFlow's carry instance keys), so every
process must issue them in one order, whatever order TensorFlow runs
independent ops in:

- Within one graph, each MPI op waits for the one made before it.
- Across graphs (a `tf.while_loop` body, a `tf.cond` branch, a nested
  `tf.function` such as a sharded variable's gather), each MPI op also
  reads this process's ordering token (a scalar resource) and writes it
  after its exchange, like TensorFlow's `ordering_token`, so automatic
  control dependencies order every op holding it (`While`, `If` and call
  ops included) in program order. Without it, a `While` op (resource
  inputs, so no chain of stateless-resource ops reaches it) ran its first
  weight gathers while ops before the loop still ran theirs: under
  ModelParallel, keras-hub's `generate` paired different weights' gathers
  across ranks and returned other tokens per rank (with top-k, an
  out-of-range index on one rank and a hang on the other).
- Every collective first exchanges a small header (count, kind, dtype,
  shapes); if the ranks' differ, every rank raises, naming each rank's op,
  before any bytes move. That exchange is also the wait for every rank
  (`_agree`).

Buffers are 64-byte aligned, so TensorFlow takes the results uncopied; one
in-place Allreduce per dtype per call. MPI has no bfloat16 or float16 sum:
those sum as float32 and cast back (gathers move their bits unchanged).
One replica per process (`transport.choose` keeps gRPC otherwise): the
ranks are the replicas, so no local sum precedes the exchange.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import zlib
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from keras_replicator._src.core import trace_events
from keras_replicator._src.upstream import cross_device_ops

_ALIGN = 64
# Summed as float32 (MPI has no half-precision sum).
_SUM_AS = {tf.bfloat16: tf.float32, tf.float16: tf.float32}
# Moved as integers of their width (MPI has no such datatype).
_MOVE_AS = {tf.bfloat16: tf.int16, tf.float16: tf.int16}


def _comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def install(extended, timeout_seconds: float | None = None) -> None:
    """Makes `extended`'s collectives between processes go over MPI.

    `extended` is a `CollectiveAllReduceExtended` with one local replica;
    `timeout_seconds` bounds each collective (None: unbounded). Raises
    `ValueError` if the process holds several replicas.
    """
    if len(extended.worker_devices) != 1:
        raise ValueError(
            "The MPI transport carries one replica per process. Received: "
            f"{len(extended.worker_devices)} replicas on this process"
        )
    size = _comm().Get_size()
    if size != extended._num_workers:  # noqa: SLF001
        raise ValueError(
            "The MPI world and the cluster differ: run one worker per MPI "
            f"rank. Received: MPI size {size}, "
            f"{extended._num_workers} workers"  # noqa: SLF001
        )
    for name in ("_cross_device_ops", "_host_cross_device_ops"):
        ops = getattr(extended, name, None)
        if isinstance(ops, cross_device_ops.CollectiveAllReduce):
            ops._launchers = [  # noqa: SLF001
                MpiLauncher(device, timeout_seconds)
                for device in ops._devices  # noqa: SLF001
            ]


class MpiLauncher:
    """One replica's collectives, over MPI.

    The `CollectiveReplicaLauncher` methods that `CollectiveAllReduce` and
    `collectives.py` call, plus `all_to_all` (TensorFlow's launcher lacks
    it); each is one MPI call (sums: one Allreduce per dtype).
    """

    def __init__(self, device: str, timeout_seconds: float | None = None):
        self._device = device
        self._timeout = timeout_seconds

    def can_order_nccl(self) -> bool:
        return True

    def all_reduce(self, input_tensor, control_input=None, options=None):
        """Sums one tensor over the processes."""
        del options
        deps = [] if control_input is None else [control_input]
        with tf.control_dependencies(deps):
            return self.batch_all_reduce([[input_tensor]])[0]

    def batch_all_reduce(self, input_tensor_packs, options=None):
        """Sums every tensor of every pack over the processes, in one call."""
        del options
        flat = [t for pack in input_tensor_packs for t in pack]
        with tf.device(self._device):
            return all_reduce_sum(flat, self._timeout)

    def _all_gather(self, input_tensor, options=None):
        """Axis-0 concatenation of equal shapes: no sizes are exchanged.

        For `collectives.all_gather_equal` (shapes may not be static).
        """
        del options
        with tf.device(self._device):
            return all_gather(input_tensor, self._timeout, equal=True)

    def all_gather(self, input_tensor, axis, options=None):
        """Concatenates every process's tensor along `axis`."""
        del options
        rank = input_tensor.shape.rank
        with tf.device(self._device):
            if axis == 0 or rank is None:
                return all_gather(input_tensor, self._timeout)
            perm = [axis] + [i for i in range(rank) if i != axis]
            back = [perm.index(i) for i in range(rank)]
            moved = tf.transpose(input_tensor, perm)
            return tf.transpose(all_gather(moved, self._timeout), back)

    def all_to_all(self, pieces):
        """Sends `pieces[j]` to rank `j` (`collectives.all_to_all_equal`)."""
        with tf.device(self._device):
            return all_to_all(pieces, self._timeout)

    def all_reduce_indexed_slices(self, input_slices, options=None):
        """Sums `IndexedSlices`: their rows and indices, gathered."""
        del options
        with tf.device(self._device):
            values = all_gather(input_slices.values, self._timeout)
            indices = all_gather(input_slices.indices, self._timeout)
        return tf.IndexedSlices(values, indices, input_slices.dense_shape)


def all_reduce_sum(
    tensors: Sequence[tf.Tensor], timeout_seconds: float | None = None
) -> list[tf.Tensor]:
    """Sums dense tensors over the MPI processes: one Allreduce per dtype.

    Any shapes and dtypes; returns the sums shaped and typed like `tensors`.
    `timeout_seconds` bounds the exchange (None: unbounded).
    """
    if not tensors:
        return []
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    moved = [
        tf.cast(t, _SUM_AS[t.dtype]) if t.dtype in _SUM_AS else t
        for t in tensors
    ]

    def run(arrays, name):
        return _sum_arrays(arrays, timeout_seconds, name)

    outs = _ordered(run, moved, [t.dtype for t in moved], "all-reduce")
    results = []
    for t, out in zip(tensors, outs, strict=True):
        out.set_shape(t.shape)
        results.append(tf.cast(out, t.dtype) if t.dtype in _SUM_AS else out)
    return results


def all_gather(
    tensor: tf.Tensor, timeout_seconds: float | None = None, equal: bool = False
) -> tf.Tensor:
    """Concatenates every process's tensor along axis 0, in rank order.

    The tensors may differ along axis 0 only. With `equal`, every process's
    tensor has this one's shape when it runs (static or not: ModelParallel
    pads its rows to the most any replica has): the header check holds
    every dimension equal and one `Allgather` moves the bytes.
    `timeout_seconds` bounds the exchange (None: unbounded).
    """
    tensor = tf.convert_to_tensor(tensor)
    moved = _moved(tensor)

    def run(arrays, name):
        return (_gather_array(arrays[0], timeout_seconds, equal, name),)

    (out,) = _ordered(run, [moved], [moved.dtype], "all-gather")
    if equal and tensor.shape.rank and tensor.shape[0] is not None:
        size = _comm().Get_size()
        out.set_shape([size * tensor.shape[0], *tensor.shape[1:]])
    elif tensor.shape.rank is not None:
        out.set_shape([None, *tensor.shape[1:]])
    return _restored(out, tensor.dtype)


def all_to_all(
    pieces: tf.Tensor, timeout_seconds: float | None = None
) -> tf.Tensor:
    """Sends `pieces[j]` to rank `j`; the result's `[j]` is from rank `j`.

    `pieces` has the same shape on every rank, its first dimension the
    number of ranks. `timeout_seconds` bounds the exchange (None: none).
    """
    pieces = tf.convert_to_tensor(pieces)
    moved = _moved(pieces)

    def run(arrays, name):
        comm = _comm()
        send = np.ascontiguousarray(arrays[0])
        _agree(comm, _ALL_TO_ALL, [send], timeout_seconds, name)
        out = _aligned(send.size, send.dtype).reshape(send.shape)
        _exchange(
            comm,
            out.nbytes,
            lambda: comm.Ialltoall(send, out),
            lambda: comm.Alltoall(send, out),
            timeout_seconds,
            "an all-to-all",
        )
        return (out,)

    (out,) = _ordered(run, [moved], [moved.dtype], "all-to-all")
    out.set_shape(pieces.shape)
    return _restored(out, pieces.dtype)


def _moved(tensor: tf.Tensor) -> tf.Tensor:
    """`tensor` as MPI moves it: bools as bytes, 16-bit floats as bits."""
    if tensor.dtype == tf.bool:
        return tf.cast(tensor, tf.int8)
    if tensor.dtype in _MOVE_AS:
        return tf.bitcast(tensor, _MOVE_AS[tensor.dtype])
    return tensor


def _restored(moved: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """A `_moved` tensor of `dtype` as it was."""
    if dtype == tf.bool:
        return tf.cast(moved, tf.bool)
    return tf.bitcast(moved, dtype) if dtype in _MOVE_AS else moved


def _ordered(fn, inputs, dtypes, kind):
    """Runs `fn(arrays, name)` as one stateful op, in this process's order.

    `name` is the op's name, for errors and the timeline (as `kind`,
    `core/trace_events.py`). In a graph the op waits for the graph's
    previous MPI op and reads the ordering token before its exchange and
    writes it after, ordering it against every op holding the token, in any
    function, loop body or branch (the module docstring says why).
    """
    label = {"name": "an eager call"}

    def call(*arrays):
        if not trace_events.recording():
            return fn(arrays[:-1], label["name"])
        begin = trace_events.now()
        out = fn(arrays[:-1], label["name"])
        nbytes = sum(a.nbytes for a in arrays[:-1])
        trace_events.collective(kind, label["name"], nbytes, begin)
        return out

    if tf.executing_eagerly():
        return _listed(
            tf.numpy_function(
                call, [*inputs, tf.zeros([], tf.int64)], dtypes, stateful=True
            )
        )
    token = _ordering_token()
    graph = tf.compat.v1.get_default_graph()
    previous = getattr(graph, "_kr_mpi_last", None)
    deps = [] if previous is None else [previous]
    with tf.control_dependencies(deps):
        order = tf.raw_ops.ReadVariableOp(resource=token, dtype=tf.int64)
        outs = _listed(
            tf.numpy_function(call, [*inputs, order], dtypes, stateful=True)
        )
    label["name"] = outs[0].op.name
    with tf.control_dependencies([outs[0].op]):
        tf.raw_ops.AssignVariableOp(resource=token, value=order + 1)
    graph._kr_mpi_last = outs[0].op  # noqa: SLF001
    return outs


def _ordering_token():
    """This process's ordering token: a scalar resource, made once, eagerly.

    Raw resource ops: a `tf.Variable` made in a replicator's scope would be
    distributed, its initial value broadcast with a collective.
    """
    global _TOKEN
    if _TOKEN is None:
        with tf.init_scope():
            _TOKEN = tf.raw_ops.VarHandleOp(
                dtype=tf.int64,
                shape=[],
                shared_name=f"keras_replicator_mpi_order_{os.getpid()}",
            )
            tf.raw_ops.AssignVariableOp(
                resource=_TOKEN, value=tf.constant(0, tf.int64)
            )
    return _TOKEN


_TOKEN = None


def _listed(outs):
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _aligned(count: int, dtype) -> np.ndarray:
    """An uninitialised 1-D array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(count * dtype.itemsize + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start : start + count * dtype.itemsize].view(dtype)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _sum_arrays(arrays, timeout, name="an eager call"):
    """Sums `arrays` over the ranks: one in-place Allreduce per dtype."""
    from mpi4py import MPI

    comm = _comm()
    _agree(comm, _SUM, arrays, timeout, name)
    out = [None] * len(arrays)
    by_dtype: dict[str, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype.str, []).append(i)
    for key in sorted(by_dtype):
        indices = by_dtype[key]
        dtype = np.dtype(key)
        # Each value starts 64-byte aligned, so TensorFlow wraps it uncopied.
        offsets, total = [], 0
        for i in indices:
            offsets.append(total)
            total += _padded(arrays[i].nbytes) // dtype.itemsize
        buffer = _aligned(total, dtype)
        for i, start in zip(indices, offsets, strict=True):
            buffer[start : start + arrays[i].size] = arrays[i].reshape(-1)
        _exchange(
            comm,
            buffer.nbytes,
            lambda b=buffer: comm.Iallreduce(MPI.IN_PLACE, b, MPI.SUM),
            lambda b=buffer: comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM),
            timeout,
            f"an all-reduce of {dtype}",
        )
        for i, start in zip(indices, offsets, strict=True):
            a = arrays[i]
            out[i] = buffer[start : start + a.size].reshape(a.shape)
    return out


def _gather_array(array, timeout, equal=False, name="an eager call"):
    """Concatenates every rank's `array` along axis 0."""
    comm = _comm()
    send = np.ascontiguousarray(array).reshape(-1)
    if equal:
        _agree(comm, _EQUAL_GATHER, [array], timeout, name)
        out = _aligned(send.size * comm.Get_size(), array.dtype)
        _exchange(
            comm,
            out.nbytes,
            lambda: comm.Iallgather(send, out),
            lambda: comm.Allgather(send, out),
            timeout,
            "an all-gather",
        )
        rows = array.shape[0] * comm.Get_size() if array.ndim else -1
        return out.reshape((rows, *array.shape[1:]) if array.ndim else -1)
    # The headers carry each rank's rows: no exchange of the lengths.
    rows = _agree(
        comm,
        _GATHER,
        [array],
        timeout,
        name,
        rows=array.shape[0] if array.ndim else 1,
    ).tolist()
    row = int(np.prod(array.shape[1:], dtype=np.int64)) if array.ndim else 1
    counts = [r * row for r in rows]
    out = _aligned(sum(counts), array.dtype)
    comm.Allgatherv(send, (out, counts))
    return out.reshape((sum(rows), *array.shape[1:]) if array.ndim else -1)


# A collective's kinds, as its header names them.
_SUM, _GATHER, _EQUAL_GATHER, _ALL_TO_ALL = 1, 2, 3, 4
_KIND_NAMES = {
    _SUM: "an all-reduce",
    _GATHER: "an all-gather",
    _EQUAL_GATHER: "an all-gather of equal lengths",
    _ALL_TO_ALL: "an all-to-all",
}


class CollectiveMismatchError(RuntimeError):
    """The ranks reached collectives that differ; raised before bytes move.

    Differ in count, order, shape or dtype; raised on every rank.
    """


def _agree(comm, kind, arrays, timeout, name, rows=0) -> np.ndarray:
    """Checks that every rank is at this same collective; waits for them.

    Each rank's header: its collective count, `kind`, a digest of dtypes
    and shapes (bar an all-gather's first dimension) and one of the op's
    `name` (every process traces the same program; an extra collective on
    one rank pairs its next ones with same-shaped ops of other names). One
    small `Iallgather`, polled with `timeout`. Every rank sees every header,
    so on a difference every rank raises `CollectiveMismatchError`, naming
    each rank's op; a late rank raises `TimeoutError`. It is also the wait
    before a large exchange: MPICH spins a core in a blocking call, which
    would slow ranks still computing on the same cores. `rows` is this
    rank's axis-0 count (`_GATHER`); returns every rank's, in rank order.
    """
    global _COUNT
    _COUNT += 1
    shapes = ", ".join(
        a.dtype.name
        + str(["*", *a.shape[1:]] if kind == _GATHER else list(a.shape))
        for a in arrays
    )
    header = np.array(
        [
            _COUNT,
            kind,
            zlib.crc32(shapes.encode()),
            zlib.crc32(name.encode()),
            rows,
        ],
        np.int64,
    )
    everyone = np.empty((comm.Get_size(), header.size), np.int64)
    dtypes = ", ".join(sorted({str(a.dtype) for a in arrays}))
    what = f"{_KIND_NAMES[kind]} of {dtypes}"
    _wait(comm.Iallgather(header, everyone), comm, timeout, what, name)
    if (everyone[:, :4] != header[:4]).any():
        # Every rank saw these headers, so every rank is here.
        ops = comm.allgather(
            f"{name}: collective #{_COUNT}, {_KIND_NAMES[kind]} of {shapes}"
        )
        listed = "; ".join(f"rank {r}: {op}" for r, op in enumerate(ops))
        raise CollectiveMismatchError(
            "The MPI ranks reached collectives that differ (their count, "
            "order, kind, dtype or shape): every rank must issue the same "
            "collectives in the same order. Nothing was exchanged. "
            f"Received: {listed}"
        )
    return everyone[:, 4]


# How many collectives this process has run (every rank's must agree).
_COUNT = 0


def _exchange(comm, nbytes, start, call, timeout, what):
    """Runs one collective whose ranks have all arrived (`_agree`).

    Up to `_SMALL` bytes, `start()`'s request is polled (`_wait`); larger,
    the blocking `call()` only moves bytes.
    """
    if nbytes <= _SMALL:
        _wait(start(), comm, timeout, what)
    else:
        call()


def _wait(request, comm, timeout, what, name=None):
    """Polls `request` until it completes, giving the core away as it waits.

    Polling a small collective itself is one exchange; a barrier first
    would be two. Polls spin briefly (a peer microseconds behind), then
    yield the core (to the peer, on an oversubscribed host) for up to
    `_YIELD_SECONDS`, then sleep `_NAP` between polls, so a peer a step
    behind costs no core. Each poll also progresses the collective (MPI
    progresses a non-blocking call when it is tested).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    polls = 0
    yield_until = None
    while not request.Test():
        polls += 1
        if polls < _SPINS:
            continue
        now = time.monotonic()
        if yield_until is None:
            yield_until = now + _YIELD_SECONDS
        if deadline is not None and now > deadline:
            _abort_at_exit(comm)
            raise TimeoutError(
                f"The MPI transport waited {timeout:g} s for the other ranks "
                f"at {what} on rank {comm.Get_rank()} of {comm.Get_size()}: "
                "a peer is stuck or gone (collective_timeout_seconds)."
                + (f" This rank's op: {name}." if name else "")
            )
        if now < yield_until:
            os.sched_yield()
        else:
            time.sleep(_NAP)


def _abort_at_exit(comm) -> None:
    """Aborts the MPI job at exit, once a collective is left pending.

    MPI cannot cancel a timed-out collective and MPI_Finalize (mpi4py's, at
    exit) would wait for it as long as the stuck peer; aborting before it
    lets the launcher (mpiexec, srun) end every rank, the stuck one too.
    """
    global _ABORT_REGISTERED
    if _ABORT_REGISTERED:
        return
    _ABORT_REGISTERED = True

    def abort():
        sys.stderr.write(
            "keras-replicator: an MPI collective timed out and is still "
            "pending; MPI cannot finalize with it, so this rank aborts the "
            "MPI job (MPI_Abort, exit code 1).\n"
        )
        sys.stderr.flush()
        comm.Abort(1)

    atexit.register(abort)


_ABORT_REGISTERED = False

# Polls before yielding; seconds they yield before sleeping; the sleep
# between later polls. Above _SMALL bytes, one blocking call moves the bytes
# (MPI progresses a non-blocking call only when tested, so a large one
# polled between sleeps would move slowly).
_SPINS = 64
_YIELD_SECONDS = 2e-3
_NAP = 5e-4
_SMALL = 1 << 20
