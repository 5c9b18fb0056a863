"""Preemption: every worker stops at the same step, saves there and exits.

Spot VMs, Kubernetes evictions and Slurm (`#SBATCH --signal`) send SIGTERM
or a chosen signal seconds before killing a job. During `fit` under
`LocalReplicator` or `MultiWorkerReplicator`, the signals in
`KERAS_REPLICATOR_PREEMPTION_SIGNALS` (default `SIGTERM,SIGUSR1`) only set a
flag. The workers agree on it at the same train batch end, the fit's
`BackupAndRestore` callbacks back up at that step, and every process exits
with `EXIT_CODE` (75, `EX_TEMPFAIL`); the next start resumes there
(`patches/backup_and_restore.py`).

A single process checks its flag every step, for free. Several workers
check by one all-reduce of the flag and each worker's estimate of how many
steps take `KERAS_REPLICATOR_PREEMPTION_CHECK_SECONDS` (default 1), which
also picks the next check's step identically everywhere. A signal is acted
on within about that time plus one step, if step times stay steady
(intervals are at most 100 steps and at most double per check).

Handlers exist only during `fit`. A signal after the last check of a fit
that runs to its end is acted on at the end (`Agreement.should_stop_at_end`,
in the preemption patch's `on_train_end`); one during a fit that returns
otherwise (stopped early) is re-delivered to the previous handler.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from keras_replicator._src.core import env

# sysexits.h EX_TEMPFAIL ("retry"): restart policies tell it from a crash.
EXIT_CODE = 75
DEFAULT_SIGNALS = "SIGTERM,SIGUSR1"
DEFAULT_CHECK_SECONDS = 1.0
# A preempted process not exited after this (a stuck `finally`, a collective
# at interpreter exit) is ended.
_EXIT_DEADLINE_SECONDS = 20.0
# The longest interval between checks, in steps.
_MAX_INTERVAL = 100


def signals_from_env() -> tuple[signal.Signals, ...]:
    """The signals in `KERAS_REPLICATOR_PREEMPTION_SIGNALS`, in order.

    Raises ValueError for a name that is not a catchable signal here.
    """
    text = os.environ.get(env.PREEMPTION_SIGNALS, DEFAULT_SIGNALS)
    out = []
    for name in (n.strip().upper() for n in text.split(",")):
        if not name:
            continue
        full = name if name.startswith("SIG") else f"SIG{name}"
        sig = getattr(signal.Signals, full, None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"`{env.PREEMPTION_SIGNALS}` must name catchable signals, "
                f"e.g. 'SIGTERM,SIGUSR1'. Received: {text!r}"
            )
        out.append(sig)
    return tuple(dict.fromkeys(out))


def check_seconds_from_env() -> float:
    """`KERAS_REPLICATOR_PREEMPTION_CHECK_SECONDS`; ValueError unless > 0."""
    text = os.environ.get(env.PREEMPTION_CHECK_SECONDS)
    if text is None:
        return DEFAULT_CHECK_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(
            f"`{env.PREEMPTION_CHECK_SECONDS}` must be a positive number of "
            f"seconds. Received: {text!r}"
        )
    return value


class _Flag:
    """The signal received (process-wide), set from the signal handler."""

    def __init__(self):
        self.signum: int | None = None
        # Monotonic arrival: the hang watchdog bounds the wait for a step
        # end until one acts on it (`acting`; then `leave` is bounded).
        self.since = 0.0
        self.acting = False


_flag = _Flag()


def signal_name(signum: int) -> str:
    """`"SIGTERM"` for 15, and so on."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def pending() -> int | None:
    """The preemption signal this process received during `fit`, if any."""
    return _flag.signum


def pending_since() -> float | None:
    """Monotonic time the pending signal came; None if none or acted on."""
    if _flag.signum is None or _flag.acting:
        return None
    return _flag.since


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Installs the preemption handlers for one `fit`, in the main thread.

    (Python delivers signals there.) Nested calls keep the outer handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = signals_from_env()
    previous = {}
    for sig in sigs:
        current = signal.getsignal(sig)
        if current is _handler:
            continue
        previous[sig] = current
        signal.signal(sig, _handler)
    try:
        yield
    except BaseException:
        # An error ends the fit: it, not a re-delivered signal, reports.
        _restore(previous)
        if previous:
            _flag.signum = None
        raise
    _restore(previous)
    if previous and _flag.signum is not None:
        # Received, but fit ended before acting on it: deliver it again.
        signum, _flag.signum = _flag.signum, None
        signal.raise_signal(signum)


def _restore(previous) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _handler(signum, frame):
    del frame
    if _flag.signum is None:
        _flag.since = time.monotonic()
        _flag.acting = False
        _flag.signum = signum


class Agreement:
    """Decides, identically on every worker, at which step to stop."""

    def __init__(self, strategy: Any):
        self._strategy = strategy
        self._workers = int(getattr(strategy, "num_workers", 1) or 1)
        self._seconds = check_seconds_from_env()
        self._steps = 0
        self._next_check = 1
        self._interval = 1
        self._since = time.monotonic()
        self._since_step = 0

    def should_stop(self) -> bool:
        """Called at every train batch end, on every worker."""
        self._steps += 1
        if self._workers == 1:
            return _acting(_flag.signum is not None)
        if self._steps < self._next_check:
            return False
        from keras_replicator._src import collectives

        elapsed = time.monotonic() - self._since
        per_step = elapsed / max(1, self._steps - self._since_step)
        proposal = min(
            _MAX_INTERVAL, max(1, int(self._seconds / max(per_step, 1e-9)))
        )
        local = np.array(
            [float(_flag.signum is not None), float(proposal)], np.float64
        )
        total = collectives.sum_over_workers(
            self._strategy, local, self._workers
        )
        # The same sum on every worker, so the same next step everywhere.
        self._interval = max(
            1, min(int(total[1] // self._workers), 2 * self._interval)
        )
        self._next_check = self._steps + self._interval
        self._since, self._since_step = time.monotonic(), self._steps
        return _acting(bool(total[0] > 0))

    def should_stop_at_end(self) -> bool:
        """Called once at the end of a fit not stopped early.

        Every worker reaches it after the same steps (none in a fit resumed
        at its end), so one more sum agrees on a late signal.
        """
        if self._workers == 1:
            return _acting(_flag.signum is not None)
        from keras_replicator._src import collectives

        local = np.array([float(_flag.signum is not None), 0.0], np.float64)
        total = collectives.sum_over_workers(
            self._strategy, local, self._workers
        )
        return _acting(bool(total[0] > 0))


def _acting(stop: bool) -> bool:
    """`stop`; if true, the pending signal is being acted on."""
    if stop:
        _flag.acting = True
    return stop


def say(message: str) -> None:
    """Prints `[keras-replicator] message` on a line of its own (stderr).

    Keras' progress bar keeps its line open (redrawn after a carriage
    return) and stdout and stderr often share a terminal or pipe (`launch`
    merges them), so an open bar's line is ended first (`progress_bar`).
    """
    if _bar.open:
        sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"[keras-replicator] {message}", file=sys.stderr, flush=True)


class _Bar:
    open = False


_bar = _Bar()


@contextlib.contextmanager
def progress_bar(verbose) -> Iterator[None]:
    """Marks a `fit` whose bar may hold an open line (`verbose` 1, "auto")."""
    saved = _bar.open
    _bar.open = verbose in (1, "auto")
    try:
        yield
    finally:
        _bar.open = saved


def leave(message: str) -> None:
    """Prints `message` and raises SystemExit(`EXIT_CODE`).

    SystemExit lets `finally` blocks run; a process still alive
    `_EXIT_DEADLINE_SECONDS` later is ended with that code.
    """
    # Acted on: `handling` must not deliver it again on the way out.
    _flag.signum = None
    say(message)
    global _exit_deadline
    _exit_deadline = threading.Timer(
        _EXIT_DEADLINE_SECONDS, os._exit, (EXIT_CODE,)
    )
    _exit_deadline.daemon = True
    _exit_deadline.start()
    raise SystemExit(EXIT_CODE)


_exit_deadline: threading.Timer | None = None


def cancel_exit_deadline() -> None:
    """Keeps a process that caught `leave`'s SystemExit alive (tests)."""
    if _exit_deadline is not None:
        _exit_deadline.cancel()
