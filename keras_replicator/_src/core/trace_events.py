"""The timeline's recorder: what each process did, and when (a leaf module).

While a `kr.callbacks.Timeline` records (`KERAS_REPLICATOR_TIMELINE=path`
adds one to every `fit` under a replicator), this process appends events
here: its steps (the callback), each collective between processes (the
MPI transport's own calls, `mpi_collectives.py`; over gRPC, markers placed
around TensorFlow's collectives when the step is traced, `TimedLauncher`
in `callbacks/timeline.py`), and its saves and restores (`BackupAndRestore`
and sharded checkpoints). An event is Chrome's trace format's complete
event (`"ph": "X"`), in microseconds of the wall clock, so that the events
of processes on one host line up (across hosts, as well as their clocks
agree). Not recording, every call here returns at its first check.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Iterator

_lock = threading.Lock()
_events: list[dict] = []
_recording = [False]
# Collectives begun and not yet ended, by token (gRPC markers).
_open: dict[int, tuple] = {}
_tokens = itertools.count(1)

# The rows of a process in the trace, by category.
STEP = "step"
COLLECTIVE = "collective"
SAVE = "save"


def recording() -> bool:
    """Whether a timeline is recording in this process."""
    return _recording[0]


def start() -> None:
    """Starts recording afresh (the events of an earlier fit are dropped)."""
    with _lock:
        _events.clear()
        _open.clear()
        _recording[0] = True


def stop() -> list[dict]:
    """Stops recording; returns the events, in the order they ended."""
    with _lock:
        _recording[0] = False
        events = list(_events)
        _events.clear()
        _open.clear()
    return events


def now() -> float:
    """The wall clock, in microseconds."""
    return time.time_ns() / 1000.0


def add(name: str, category: str, begin: float, end: float, **args) -> None:
    """Records one event from `begin` to `end` (microseconds)."""
    if not _recording[0]:
        return
    event = {
        "name": name,
        "cat": category,
        "ph": "X",
        "ts": begin,
        "dur": max(0.0, end - begin),
        "args": args,
    }
    with _lock:
        _events.append(event)


@contextlib.contextmanager
def span(name: str, category: str, **args) -> Iterator[None]:
    """Records the block it wraps as one event."""
    if not _recording[0]:
        yield
        return
    begin = now()
    try:
        yield
    finally:
        add(name, category, begin, now(), **args)


def spanned(name: str, category: str):
    """A decorator: each call of the function is one event (`span`)."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with span(name, category):
                return function(*args, **kwargs)

        return wrapper

    return decorate


def collective(kind: str, op: str, nbytes: int, begin: float) -> None:
    """Records a collective this process reached at `begin`, ending now.

    Args:
        kind: What it does (`"all-reduce"`, `"all-gather"`, ...).
        op: Its op's name in the step's graph, the same on every process,
            so that the trace's reader pairs the processes' calls (their
            wait for each other is the latest arrival less their own).
        nbytes: The bytes this process sends.
        begin: When this process reached it (`now()`).
    """
    add(kind, COLLECTIVE, begin, now(), op=op, bytes=int(nbytes))


def arrive() -> int:
    """A token for a collective this process reaches now (gRPC markers)."""
    token = next(_tokens)
    if _recording[0]:
        with _lock:
            _open[token] = now()
    return token


def leave(token: int, kind: str, op: str, nbytes: int) -> None:
    """Ends the collective of `token` (`arrive`) now."""
    with _lock:
        begin = _open.pop(token, None)
    if begin is not None:
        collective(kind, op, nbytes, begin)
