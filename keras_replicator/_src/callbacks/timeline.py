"""A timeline of every process's steps: one trace for Chrome or Perfetto.

`kr.callbacks.Timeline("trace.json")` in `fit`'s callbacks, or
`KERAS_REPLICATOR_TIMELINE=trace.json` in every process's environment (adds
one to each `fit` under a replicator), writes one trace of every process for
`chrome://tracing` or https://ui.perfetto.dev. Each process (`worker k`) has
three rows:

- `step`: each train batch, start to end (compute, its collectives, and
  the wait for its input, which the step's graph holds);
- `collective`: each collective by kind (`all-reduce`, `all-gather`,
  `all-to-all`), with its op, bytes and `wait_us`: the latest arrival of
  the same op on any process, less this one's;
- `save`: each `BackupAndRestore` save and restore, and each sharded
  checkpoint's save (the part in the step's thread) and load.

After `fit`, process 0 merges the parts and prints the slowest process (most
compute a step: the others wait for it) and what it waited on most. Notes:
- With several processes each writes `<path>.process-<k>.json` and process
  0 merges them into `path`, so `path` must be on storage all processes
  see, like sharded checkpoint directories. Process 0 waits `PART_SECONDS`,
  then merges what it has and names what is missing.
- MPI collectives are timed by the transport. gRPC ones run in the step's
  graph: steps traced while recording get a `tf.py_function` marker before
  and after each (run at every call, recording nothing once stopped);
  steps traced earlier, or XLA-compiled, are not timed.
- Times are wall-clock: processes on one host line up; across hosts, waits
  shorter than the clock skew are not to be believed.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import statistics
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from keras_replicator._src import mpi_collectives
from keras_replicator._src.core import trace_events
from keras_replicator._src.sharding import sharded
from keras_replicator._src.upstream import cross_device_ops

# How long process 0 waits for the other processes' parts.
PART_SECONDS = 60.0
_ROWS = {trace_events.STEP: 1, trace_events.COLLECTIVE: 2, trace_events.SAVE: 3}


class Timeline(keras.callbacks.Callback):
    """Writes one trace of every process's steps, collectives and saves.

    Args:
        path: The trace file (JSON, Chrome's trace event format), on storage
            every process sees.

    Example:
    ```python
    model.fit(x, y, callbacks=[kr.callbacks.Timeline("trace.json")])
    ```
    """

    def __init__(self, path):
        super().__init__()
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(
                "`path` must be the trace file's path, a non-empty string. "
                f"Received: path={path!r}"
            )
        self.path = os.fspath(path)
        self._begin = None
        self._epoch = 0
        self._steps = 0
        self._wrapped = []

    def on_train_begin(self, logs=None):
        self._steps = 0
        self._wrapped = _time_launchers(self.model.distribute_strategy)
        trace_events.start()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = trace_events.now()

    def on_train_batch_end(self, batch, logs=None):
        if self._begin is None:
            return
        self._steps += 1
        trace_events.add(
            f"step {self._steps}",
            trace_events.STEP,
            self._begin,
            trace_events.now(),
            epoch=self._epoch + 1,
            batch=int(batch),
        )
        self._begin = None

    def release(self) -> list[dict]:
        """Stops recording and puts the collectives' launchers back.

        Called by `on_train_end`, and by `fit` when it raises (Keras calls
        no callback then) so later traces get no markers.

        Returns:
            The events recorded since `on_train_begin`.
        """
        events = trace_events.stop()
        for ops, launchers in self._wrapped:
            ops._launchers = launchers
        self._wrapped = []
        return events

    def on_train_end(self, logs=None):
        events = self.release()
        process, processes = sharded.process_of(self.model.distribute_strategy)
        if processes == 1:
            trace = merge({0: events})
            _write(self.path, trace)
            _say(summary(trace, self.path))
            return
        _write(f"{self.path}.process-{process}.json", events)
        if process != 0:
            return
        parts, missing = _read_parts(self.path, processes)
        trace = merge(parts)
        _write(self.path, trace)
        line = summary(trace, self.path)
        if missing:
            line += f" No part from process {', '.join(map(str, missing))}."
        _say(line)


def release_all(callbacks) -> None:
    """`Timeline.release` of each timeline among `fit`'s `callbacks`."""
    callbacks = getattr(callbacks, "callbacks", callbacks) or ()
    for callback in callbacks:
        if isinstance(callback, Timeline):
            callback.release()


def _write(path, content) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump(content, f)
    os.replace(temporary, path)


def _read_parts(path, processes) -> tuple[dict, list]:
    deadline = time.monotonic() + PART_SECONDS
    parts: dict[int, list] = {}
    while True:
        for k in range(processes):
            name = f"{path}.process-{k}.json"
            if k not in parts and os.path.exists(name):
                with open(name) as f:
                    parts[k] = json.load(f)
                os.remove(name)
        if len(parts) == processes or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return parts, [k for k in range(processes) if k not in parts]


def _say(line: str) -> None:
    sys.stdout.flush()
    print(f"[keras-replicator] {line}", file=sys.stderr, flush=True)


def merge(parts: dict[int, list[dict]]) -> dict:
    """Merges `{process: events}` into one trace, with each collective's wait.

    Returns `{"traceEvents": [...], "displayTimeUnit": "ms"}`.
    """
    # The same op's n-th call on every process is one collective.
    arrivals: dict[tuple, list[float]] = collections.defaultdict(list)
    keyed = []
    for k, events in sorted(parts.items()):
        seen: collections.Counter = collections.Counter()
        for event in events:
            key = None
            if event["cat"] == trace_events.COLLECTIVE:
                op = event["args"]["op"]
                key = (op, seen[op])
                seen[op] += 1
                arrivals[key].append(event["ts"])
            keyed.append((k, event, key))
    trace = []
    for k in sorted(parts):
        trace.append(_meta("process_name", k, 0, name=f"worker {k}"))
        for row, tid in _ROWS.items():
            trace.append(_meta("thread_name", k, tid, name=row))
    for k, event, key in keyed:
        event = {**event, "pid": k, "tid": _ROWS[event["cat"]]}
        if key is not None:
            wait = max(arrivals[key]) - event["ts"]
            event["args"] = {**event["args"], "wait_us": wait}
        trace.append(event)
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def _meta(what, pid, tid, **args) -> dict:
    return {"name": what, "ph": "M", "pid": pid, "tid": tid, "args": args}


def summary(trace: dict, path: str) -> str:
    """The line that names the slowest process and what it waited on.

    Compute is a step's time outside its collectives; the slowest process
    has the most median compute (the others wait for it).
    """
    by_process = collections.defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            by_process[event["pid"]].append(event)
    compute, waits, medians, steps = {}, {}, {}, {}
    for k, events in by_process.items():
        own = sorted(
            (e for e in events if e["cat"] == trace_events.STEP),
            key=lambda e: e["ts"],
        )
        if not own:
            continue
        outside, waited = [], collections.Counter()
        for step in own:
            end = step["ts"] + step["dur"]
            inside = 0.0
            for e in events:
                if e["cat"] == trace_events.STEP or not (
                    step["ts"] <= e["ts"] <= end
                ):
                    continue
                if e["cat"] == trace_events.COLLECTIVE:
                    inside += e["dur"]
                    op = f"{e['name']} {e['args']['op']}"
                    waited[op] += e["args"].get("wait_us", 0.0)
                else:
                    waited["saves and restores"] += e["dur"]
            outside.append(step["dur"] - inside)
        steps[k] = len(own)
        compute[k] = statistics.median(outside) / 1000
        medians[k] = statistics.median(e["dur"] for e in own) / 1000
        waits[k] = {op: w / len(own) / 1000 for op, w in waited.items()}
    if not steps:
        return f"timeline written to {path} (no train step recorded)."
    slowest = max(compute, key=compute.get)
    several = len(steps) > 1
    line = (
        f"timeline written to {path}: {len(steps)} process"
        f"{'es' if several else ''}, {steps[slowest]} steps. "
        f"{f'Slowest: worker {slowest}' if several else 'The process'}, "
        f"a median step of {medians[slowest]:.1f} ms, "
        f"{compute[slowest]:.1f} ms of it outside collectives"
    )
    if several:
        others = [v for k, v in compute.items() if k != slowest]
        line += f" (the others: {max(others):.1f} ms)"
    line += "."
    if waits[slowest]:
        most = max(waits[slowest], key=waits[slowest].get)
        line += (
            f" It waited most on {most}: {waits[slowest][most]:.2f} ms a step."
        )
    return line


def _time_launchers(strategy) -> list:
    """Puts markers around gRPC collectives traced from now on.

    Returns `[(ops, launchers)]` to put back at the end.
    """
    wrapped = []
    extended = strategy.extended
    for name in ("_collective_ops", "_cross_device_ops"):
        ops = getattr(extended, name, None)
        if not isinstance(ops, cross_device_ops.CollectiveAllReduce):
            continue
        launchers = ops._launchers
        # MPI's launchers time themselves (`mpi_collectives`).
        timed = (mpi_collectives.MpiLauncher, TimedLauncher)
        if any(isinstance(x, timed) for x in launchers):
            continue
        wrapped.append((ops, launchers))
        ops._launchers = [TimedLauncher(x) for x in launchers]
    return wrapped


class TimedLauncher:
    """A `CollectiveReplicaLauncher` whose collectives carry markers.

    Other attributes are the wrapped one's (`collectives.py` reads its keys
    and ordering token).
    """

    def __init__(self, launcher):
        self._inner = launcher

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def all_reduce(self, input_tensor, control_input=None, options=None):
        """Sums one tensor over the replicas."""
        (out,) = _timed(
            "all-reduce",
            [input_tensor],
            lambda ts: [self._inner.all_reduce(ts[0], control_input, options)],
        )
        return out

    def batch_all_reduce(self, input_tensor_packs, options=None):
        """Sums every pack's tensors over the replicas."""
        sizes = [len(pack) for pack in input_tensor_packs]
        flat = [t for pack in input_tensor_packs for t in pack]

        def call(tensors):
            packs, start = [], 0
            for size in sizes:
                packs.append(tensors[start : start + size])
                start += size
            return list(self._inner.batch_all_reduce(packs, options))

        return _timed("all-reduce", flat, call)

    def _all_gather(self, input_tensor, options=None):
        (out,) = _timed(
            "all-gather",
            [input_tensor],
            lambda ts: [self._inner._all_gather(ts[0], options)],
        )
        return out

    def all_gather(self, input_tensor, axis, options=None):
        """Concatenates every replica's tensor along `axis`."""
        (out,) = _timed(
            "all-gather",
            [input_tensor],
            lambda ts: [self._inner.all_gather(ts[0], axis, options)],
        )
        return out


def _probe(tensor) -> tf.Tensor:
    """One element of `tensor` (none of an empty one): a data dependency."""
    return tf.reshape(tensor, [-1])[:1]


def _timed(kind, tensors, call):
    """`call(tensors)` between a marker of arrival and one of its end.

    Markers are `tf.py_function`s (stateful: never optimized away) with a
    resource of their own: TF orders stateful ops without a resource input
    in program order, which would put one replica's markers after another's
    collective and deadlock the replicas. With a resource, a marker is
    ordered only with its collective's other marker.
    """
    if tf.executing_eagerly() or not tensors:
        return call(tensors)
    nbytes = sum((t.shape.num_elements() or 0) * t.dtype.size for t in tensors)
    label = {"op": kind}
    with tf.init_scope():
        handle = tf.raw_ops.VarHandleOp(
            dtype=tf.int64,
            shape=[],
            shared_name=f"keras_replicator_timeline_{next(_markers)}",
        )

    def arrive(*_):
        return np.int64(trace_events.arrive())

    def leave(_, token, *__):
        trace_events.leave(int(token), kind, label["op"], nbytes)
        return token

    probes = [_probe(t) for t in tensors]
    token = tf.py_function(arrive, [handle, *probes], tf.int64)
    with tf.control_dependencies([token]):
        tensors = [tf.identity(t) for t in tensors]
    outs = call(tensors)
    label["op"] = _collective_name(outs[0].op)
    probes = [_probe(o) for o in outs]
    left = tf.py_function(leave, [handle, token, *probes], tf.int64)
    with tf.control_dependencies([left]):
        return [tf.identity(o) for o in outs]


_markers = itertools.count()


def _collective_name(op) -> str:
    """The collective op that `op` (an output's) comes from, by name."""
    queue, seen = [op], set()
    while queue and len(seen) < 32:
        op = queue.pop(0)
        if op.type.startswith("Collective"):
            return op.name
        seen.add(op.name)
        queue.extend(i.op for i in op.inputs if i.op.name not in seen)
    return queue[0].name if queue else op.name
