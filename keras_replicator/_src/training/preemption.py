"""Preemption: every worker stops at the same step, saves there and exits.

Spot VMs, Kubernetes evictions and Slurm (`#SBATCH --signal`) send SIGTERM
or a chosen signal some seconds before they kill a job. During `fit` under
`LocalReplicator` or `MultiWorkerReplicator`, the signals named by
`KERAS_REPLICATOR_PREEMPTION_SIGNALS` (default `SIGTERM,SIGUSR1`) only set a
flag. At a train batch end the workers agree on it, the same step on every
worker; then the `BackupAndRestore` callbacks of the fit write their backup
at that step and every process exits with `EXIT_CODE` (75, `EX_TEMPFAIL`:
"try again"). The next start of the same command resumes at that step
(`patches/backup_and_restore.py`).

Agreeing costs one collective, so multi-worker fit does not ask every step:
one all-reduce of two numbers, the flag and each worker's estimate of how
many steps take `KERAS_REPLICATOR_PREEMPTION_CHECK_SECONDS` (default 1),
also picks the step of the next check, identically on every worker. A
signal is acted on within about that time plus one step, as long as steps
take about as long as at the previous check (intervals are at most 100
steps and at most double from one check to the next). A single process
checks its flag every step, for free.

Outside `fit` the handlers are not installed. A signal that arrives after
the last step's check of a `fit` that runs to its last epoch is acted on
at the training's end (`Agreement.should_stop_at_end`, in the preemption
patch's `on_train_end`). One that arrives during a `fit` that ends
otherwise (stopped early) is delivered again, to the previous handler,
when the `fit` returns: it is never swallowed.
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

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to
# retry". Kubernetes, Slurm scripts and the launcher tell it from a crash.
EXIT_CODE = 75
DEFAULT_SIGNALS = "SIGTERM,SIGUSR1"
DEFAULT_CHECK_SECONDS = 1.0
# A process that stopped for preemption but has not exited after this many
# seconds (a stuck `finally`, a collective at interpreter exit) is ended.
_EXIT_DEADLINE_SECONDS = 20.0
# The longest interval between checks, in steps, however fast the steps;
# intervals also at most double from one check to the next.
_MAX_INTERVAL = 100


def signals_from_env() -> tuple[signal.Signals, ...]:
    """The preemption signals named by `KERAS_REPLICATOR_PREEMPTION_SIGNALS`.

    Returns:
        The signals, in the order named; empty if the variable is empty.

    Raises:
        ValueError: If a name is not a signal of this platform.
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
    """`KERAS_REPLICATOR_PREEMPTION_CHECK_SECONDS`, validated.

    Raises:
        ValueError: If it is not a positive number.
    """
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
        # When it came (`time.monotonic()`): the hang watchdog bounds how
        # long a signal may wait for a step end that never comes...
        self.since = 0.0
        # ...until a step end acts on it (the backup's save, then `leave`,
        # bounded by `_EXIT_DEADLINE_SECONDS`, take it from there).
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
    """When (`time.monotonic()`) the pending signal came, or None.

    None too once a step end acts on it (`Agreement` decided to stop).
    """
    if _flag.signum is None or _flag.acting:
        return None
    return _flag.since


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Installs the preemption handlers for the duration of one `fit`.

    Only in the main thread (Python delivers signals there). Nested calls
    keep the outer handlers.
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
    """Decides, identically on every worker, at which step to stop.

    Args:
        strategy: The model's replicator.
    """

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
        """Called once, at the end of a fit not stopped early.

        A signal after the last check is acted on there. Every worker
        reaches it together (after the same steps, none in a fit resumed
        at its end), so several workers agree with one more sum.
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

    During a `fit` with Keras' progress bar, the bar's line is open (it is
    redrawn after a carriage return until the epoch ends), and stdout and
    stderr often share one terminal or pipe (`keras-replicator launch`
    merges them): the message would be glued onto the bar. So the bar's
    line is ended first (`progress_bar`).
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
    """Marks a `fit` whose progress bar may hold an open line (`say`).

    Args:
        verbose: `fit`'s `verbose` argument: 1 and `"auto"` draw the bar.
    """
    saved = _bar.open
    _bar.open = verbose in (1, "auto")
    try:
        yield
    finally:
        _bar.open = saved


def leave(message: str) -> None:
    """Prints `message` and exits with `EXIT_CODE` (bounded in time).

    Raises:
        SystemExit: Always, with `EXIT_CODE`, so `finally` blocks run; if
            the process is still alive `_EXIT_DEADLINE_SECONDS` later, it
            is ended with that code.
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
