"""The hang watchdog: a process whose training stops making progress ends.

A worker that is alive but stuck (a callback that never returns, a
deadlocked input pipeline) keeps sending TensorFlow's heartbeats, so
nothing ends it, and every other worker waits in its next collective
forever. Under `LocalReplicator` and `MultiWorkerReplicator`, while `fit`,
`evaluate`, `predict` or a `replicate` step call runs, one daemon thread
per process (started by the first such loop) watches for progress:

- Progress is a batch end whose callbacks returned (Keras' loops), or a
  `replicate` step call that returned. The time between two step calls
  is the caller's own code and is not timed.
- Not timed, up to `UNTIMED_FACTOR` (5) times the timeout: the first
  step of every loop (tracing and compiling it, up to its callbacks, which
  are timed), the saves of `BackupAndRestore` and `ModelCheckpoint`, and,
  on several workers, the time another worker spends in such a save: each
  worker publishes its saves in TensorFlow's coordination-service
  key-value store (from this thread, never from the loop), and a worker
  that waits reads them before it warns or ends. The bound keeps "nothing
  hangs forever": a save can itself wait in a collective for the worker
  that is stuck.
- After `warn_seconds` without progress (the smaller of half the timeout
  and the larger of 60 s and 10 times the slowest step so far), a stall
  warning names this task and its step and, on several workers, the step
  every worker is at (published and read at that moment only), so the
  worker that lags behind is named.
- After `seconds` without progress (`KERAS_REPLICATOR_HANG_SECONDS`, or
  the replicator's `hang_seconds`; default 600; 0 turns it off) the
  process prints a header with its task and step and every thread's
  Python stack (`faulthandler`), and exits with `EXIT_CODE` (76), which
  restart policies (`launch --max-restarts`, Kubernetes, Slurm) take as
  "start again": training resumes from its backup. In an interactive
  process (a notebook kernel, `python -i`) it prints the same, then
  interrupts the loop's thread, and the loop raises a `RuntimeError`; the
  kernel lives on. An interrupt that lands where Python ignores
  exceptions (a garbage-collector or weakref callback, a `__del__`) is
  sent again at once (`_Resend`, a `sys.unraisablehook`), and any
  interrupt the loop has not acted on is sent again every
  `_RESEND_SECONDS`, until the loop sees it.
- A preemption signal (`training/preemption.py`) is acted on at a step
  end. While one waits for a step end that does not come, the bound is
  `warn_seconds`, counted from the signal or the end of a save after it
  (a first step included; a save in progress is not cut short): then the
  same as at the timeout. Once a step end acts on it, the usual bounds
  apply (its save is not timed; the exit after it is bounded by the
  preemption module).

Per step a loop only writes a few attributes and reads the monotonic
clock. The thread wakes about once a second (20 times per timeout for
timeouts under 20 s). It is a Python thread: code that holds the GIL
forever (a C extension, a `ctypes.PyDLL` call) stops it. TensorFlow
releases the GIL while it runs ops and waits in collectives, and so does
Python while it sleeps or waits; for the rest there is a backstop
(`hang_backstop.py`) that needs no GIL. It fires `backstop_margin` (the
larger of 10 s and half the timeout) after the thread would have, so the
thread keeps the first word whenever it can run: a `Timeout (H:MM:SS)!`
header and every thread's Python stack from `faulthandler`'s C thread,
then, 3 s later, exit code 76 from a POSIX timer's C thread (on Linux;
elsewhere `faulthandler` exits with 1, which `launch --max-restarts`
restarts as any failure). It is armed and moved as steps finish, and
stands down where the thread does: the same untimed bounds, nothing
between two `replicate` calls or outside the loops (the thread disarms
it within one wake-up of the loop's end). In an interactive process it
only prints the stacks.
"""

from __future__ import annotations

import ctypes
import faulthandler
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from keras_replicator._src.core import env
from keras_replicator._src.core import traits
from keras_replicator._src.training import hang_backstop
from keras_replicator._src.training import hang_peers
from keras_replicator._src.training import preemption

# sysexits.h EX_PROTOCOL, next to preemption's 75 (EX_TEMPFAIL): "start
# again", as 75, but counted as a failure by restart policies, so that a
# run that hangs every time stops being restarted.
EXIT_CODE = 76
DEFAULT_SECONDS = 600.0
HEADER = "[keras-replicator watchdog]"
# The stall warning comes after the smaller of half the timeout and the
# larger of these: a fixed floor and a multiple of the slowest step.
_WARN_FLOOR_SECONDS = 60.0
_WARN_SLOWEST_FACTOR = 10.0
# How long a warning waits for other workers to publish their step.
_SETTLE_SECONDS = 5.0
# A notebook loop still stuck this long after its interrupt is stuck
# inside TensorFlow, which no Python exception can reach.
_INTERRUPT_NOTE_SECONDS = 30.0
# An interrupt the loop has not acted on by then is sent again: code that
# catches every exception (`except BaseException`) may have eaten it. Long
# enough for a loop that did get it to unwind first; a loop stuck inside
# TensorFlow keeps one pending interrupt however often it is sent.
_RESEND_SECONDS = 5.0
# What is not timed (a first step, a save, another worker's save) is
# bounded at this many timeouts: a save can wait forever in a collective
# for a stuck worker, and the stuck one must not wait for that save.
UNTIMED_FACTOR = 5
# The backstop fires this much after the thread would have: at least the
# floor, or this fraction of the timeout.
_BACKSTOP_FLOOR_SECONDS = 10.0
_BACKSTOP_FRACTION = 0.5
_OFF = ("0", "off", "none", "")


def resolve_seconds(setting: float | None = None) -> float | None:
    """The timeout in seconds: `setting`, else the environment, else 600.

    Args:
        setting: A replicator's `hang_seconds`: None (use
            `KERAS_REPLICATOR_HANG_SECONDS`, default 600), 0 (off) or a
            positive number.

    Returns:
        The timeout, or None when the watchdog is off.

    Raises:
        ValueError: If `KERAS_REPLICATOR_HANG_SECONDS` is not a
            non-negative number or "off".
    """
    if setting is not None:
        return float(setting) if setting > 0 else None
    text = os.environ.get(env.HANG_SECONDS)
    if text is None:
        return DEFAULT_SECONDS
    if text.strip().lower() in _OFF:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or value == math.inf:
        raise ValueError(
            f"`{env.HANG_SECONDS}` must be a non-negative number of seconds "
            f"(0 or 'off' turns the hang watchdog off). Received: {text!r}"
        )
    return value or None


def check_setting(name: str, value: Any) -> None:
    """Validates a replicator's `hang_seconds` argument.

    Raises:
        ValueError: Unless `value` is None, 0 or a positive finite number.
    """
    ok = value is None or (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and 0 <= value < math.inf
    )
    if not ok:
        raise ValueError(
            f"`{name}` must be None (read `{env.HANG_SECONDS}`, default "
            f"{DEFAULT_SECONDS:g}), 0 (off) or a positive number of seconds. "
            f"Received: {name}={value!r}"
        )


def interactive() -> bool:
    """Whether this process is interactive (a notebook kernel, `python -i`).

    There the watchdog raises an error in the loop instead of ending the
    process.
    """
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    return get is not None and get() is not None


class _Frame:
    """One watched loop, or one collective outside the loops (`stepless`)."""

    def __init__(self, kind, seconds, task, cluster, where=None):
        self.kind = kind
        self.stepless = False
        self.seconds = seconds
        self.task = task
        self.cluster = cluster
        self.where = where
        # Steps finished; the one in flight is `steps + 1`.
        self.steps = 0
        self.last = time.monotonic()
        # False until the first step computed: it traces and compiles.
        self.armed = False
        self.slowest = 0.0
        self.thread = threading.get_ident()
        self.warned = False
        self.fired: float | None = None
        self.fired_after = 0.0
        # When the interrupt was last sent, and how often it was lost.
        self.sent = 0.0
        self.lost = 0
        self.resend = False
        self.noted = False

    def position(self, step: bool = True) -> str:
        """`"fit, step 51 (epoch 7)"`; without `step`, `"fit (epoch 7)"`."""
        where = self.where() if self.where is not None else None
        text = self.kind
        if step and not self.stepless:
            text = f"{self.kind}, step {self.steps + 1}"
        return f"{text} ({where})" if where else text

    def at_step(self) -> str:
        """`" step 51"`, or nothing outside a loop."""
        return "" if self.stepless else f" step {self.steps + 1}"


class _Watchdog:
    """The process-wide state and its thread."""

    def __init__(self):
        self.frames: list[_Frame] = []
        self.paused = 0
        self.paused_since = 0.0
        self.paused_wall = 0.0
        self.resumed_wall = 0.0
        # A pause began or ended: the thread publishes it.
        self.dirty = False
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        # Held while an interrupt is sent and while a loop leaves.
        self.send_lock = threading.RLock()
        self.failed = False
        # The timeout the thread last learnt of.
        self.basis: float | None = None

    def start(self) -> None:
        if self.thread is not None:
            return
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._loop, name="kr-hang-watchdog", daemon=True
                )
                self.thread.start()

    def push(self, frame: _Frame) -> None:
        self.frames.append(frame)
        if frame.seconds is not None and frame.seconds != self.basis:
            # A new timeout (rarely: not every step call): the thread may
            # have to start, or to check more often.
            self.basis = frame.seconds
            self.start()
            self.wake.set()
        _update_backstop()

    def pop(self, frame: _Frame) -> None:
        # Under the send lock: once a loop has left, no interrupt of its
        # own is sent after it.
        with self.send_lock:
            try:
                self.frames.remove(frame)
            except ValueError:
                return
        if frame.fired is not None:
            _Resend.remove(frame)
        if self.frames:
            # The enclosing loop's clock starts again (it waited for this
            # one, e.g. fit for its validation).
            outer = self.frames[-1]
            outer.last = time.monotonic()
            outer.warned = False
            _update_backstop()
        # With no loop left the backstop stays armed (at least the timeout
        # away) until the thread's next check disarms it: disarming and
        # arming again at every `replicate` call would cost two thread
        # starts a call.

    def _interval(self) -> float:
        frames = self.frames
        seconds = frames[-1].seconds if frames else None
        if seconds is None:
            return 1.0
        return min(1.0, max(0.05, seconds / 20))

    def _loop(self) -> None:
        while True:
            self.wake.wait(self._interval())
            self.wake.clear()
            try:
                self._check()
            except Exception as error:  # noqa: BLE001 - the thread lives on
                if not self.failed:
                    self.failed = True
                    _print(f"{HEADER} check failed: {error!r}")

    def _state(self, frame: _Frame) -> dict:
        return {
            "kind": frame.kind,
            "step": frame.steps + 1,
            "paused": self.paused > 0,
            "paused_since": self.paused_wall,
            "resumed": self.resumed_wall,
            "time": time.time(),
        }

    def _check(self) -> None:
        _update_backstop(disarm=True)
        frames = list(self.frames)
        frame = frames[-1] if frames else None
        if frame is None:
            return
        if self.dirty and frame.cluster is not None:
            self.dirty = False
            frame.cluster.publish(self._state(frame))
        if frame.fired is not None:
            if interactive():
                resend, frame.resend = frame.resend, False
                self.interrupt(frame, after=0 if resend else _RESEND_SECONDS)
            self._note_stuck(frame)
            return
        if frame.seconds is None:
            return
        now = time.monotonic()
        if self._unheeded(frame, now):
            return
        untimed = UNTIMED_FACTOR * frame.seconds
        if self.paused or not frame.armed:
            # A save or the first step: bounded at `untimed` only.
            since = self.paused_since if self.paused else frame.last
            if now - since >= untimed:
                what = "a checkpoint save" if self.paused else "its first step"
                self._fire(frame, now - since, {}, what)
            return
        idle = now - frame.last
        warn_after = warn_seconds(frame.seconds, frame.slowest)
        if idle < warn_after:
            return
        peers: dict[str, dict | None] = {}
        if frame.cluster is not None:
            frame.cluster.publish(self._state(frame))
            peers = frame.cluster.read()
            since = hang_peers.peer_progress(peers, idle, untimed)
            if since is not None:
                # Another worker saves, or saved since this one's last
                # step: it is what this one waits for.
                frame.last = time.monotonic() - since
                frame.warned = False
                return
        if idle >= frame.seconds:
            self._fire(frame, idle, peers)
        elif not frame.warned:
            stale = [
                p for p, s in peers.items() if not hang_peers.fresh(s, idle)
            ]
            if stale and idle < warn_after + _SETTLE_SECONDS:
                return  # They publish at their own warning; wait a little.
            frame.warned = True
            slowest = (
                ""
                if frame.stepless
                else f"; the slowest step so far took {frame.slowest:.3g} s"
            )
            _print(
                f"{HEADER} task {frame.task}: no progress for {idle:.0f} s "
                f"in {frame.position()}{slowest}."
                f"{hang_peers.steps_text(frame, peers, idle)} "
                f"Without progress this process ends in "
                f"{frame.seconds - idle:.0f} s ({env.HANG_SECONDS}="
                f"{frame.seconds:g}) and prints every thread's stack."
            )

    def _unheeded(self, frame: _Frame, now: float) -> bool:
        """Fires if a preemption signal waits for a step end too long.

        A signal during `fit` is acted on at a step end; a step that never
        ends (a deadlocked collective) would keep the process alive, deaf
        to SIGTERM, until the timeout (or five, in a first step). With a
        signal pending, the bound is the stall warning's (`warn_seconds`:
        at least 60 s, 10 times the slowest step, at most half the
        timeout), counted from the signal or the last progress after it (a
        step end, a save's end), a first step included. A save in progress
        is not cut short: killing it would lose the backup it writes.
        """
        since = preemption.pending_since()
        if since is None or self.paused:
            return False
        idle = now - max(since, frame.last)
        if idle < warn_seconds(frame.seconds, frame.slowest):
            return False
        name = preemption.signal_name(preemption.pending())
        bound = warn_seconds(frame.seconds, frame.slowest)
        where = (
            f", reaching a step end after {name} (a preemption signal waits "
            f"at most {bound:.3g} s for one)"
        )
        self._fire(frame, idle, {}, where=where)
        return True

    def _fire(
        self, frame: _Frame, idle: float, peers, what=None, where=""
    ) -> None:
        frame.fired = time.monotonic()
        frame.fired_after = idle
        in_session = interactive()
        if what is not None:
            where = (
                f", in {what}, which is given {UNTIMED_FACTOR} times the "
                "timeout"
            )
        _print(
            f"{HEADER} task {frame.task}{frame.at_step()}: no "
            f"progress for {idle:.0f} s in {frame.position(step=False)}"
            f"{where} ({env.HANG_SECONDS}={frame.seconds:g}); this process "
            f"is stuck.{hang_peers.steps_text(frame, peers, idle)} Every "
            "thread's Python stack follows (the loop's thread is where it "
            "waits)."
        )
        _dump_stacks()
        if in_session:
            hang_backstop.cancel()
            _print(
                f"{HEADER} task {frame.task}: interrupting the {frame.kind}"
                f"{'' if frame.stepless else ' loop'}, which raises a "
                "RuntimeError; this process goes on."
            )
            with self.send_lock:
                if frame in self.frames:
                    _Resend.install(frame)
            self.interrupt(frame)
            return
        _print(
            f"{HEADER} task {frame.task}: exiting with code {EXIT_CODE}, so "
            "that a restart policy (keras-replicator launch "
            "--max-restarts, Kubernetes, Slurm) starts the run again; it "
            "resumes from its BackupAndRestore backup."
        )
        os._exit(EXIT_CODE)

    def interrupt(self, frame: _Frame, after: float = 0.0) -> None:
        """Interrupts a fired loop that is still running.

        Args:
            frame: The fired loop.
            after: Only if its last interrupt is this many seconds old.
        """
        with self.send_lock:
            if frame not in self.frames:
                return  # It saw the interrupt and left.
            if time.monotonic() - frame.sent < after:
                return
            frame.sent = time.monotonic()
            _interrupt(frame.thread)

    def _note_stuck(self, frame: _Frame) -> None:
        if frame.noted:
            return
        if time.monotonic() - frame.fired < _INTERRUPT_NOTE_SECONDS:
            return
        frame.noted = True
        _print(
            f"{HEADER} task {frame.task}: the {frame.kind} loop is still "
            "stuck inside TensorFlow, where the interrupt cannot reach it; "
            "restart the kernel."
        )


_watchdog = _Watchdog()


def backstop_margin(seconds: float) -> float:
    """How long after the thread's deadline the backstop fires."""
    return max(_BACKSTOP_FLOOR_SECONDS, _BACKSTOP_FRACTION * seconds)


def _update_backstop(disarm: bool = False) -> None:
    """Moves the backstop to the innermost loop's deadline plus the margin.

    The deadline is the thread's: the timeout after the last progress, or
    `UNTIMED_FACTOR` timeouts into a first step or a save. With no timed
    loop, only the thread (`disarm`) disarms it.
    """
    frames = _watchdog.frames
    frame = frames[-1] if frames else None
    if frame is None or frame.seconds is None or frame.fired is not None:
        if disarm:
            hang_backstop.cancel()
        return
    seconds = frame.seconds
    if _watchdog.paused:
        deadline = _watchdog.paused_since + UNTIMED_FACTOR * seconds
    elif not frame.armed:
        deadline = frame.last + UNTIMED_FACTOR * seconds
    else:
        deadline = frame.last + seconds
    margin = backstop_margin(seconds)
    hang_backstop.arm(
        deadline + margin,
        slack=margin / 2,
        ends=not interactive(),
        code=EXIT_CODE,
    )


def warn_seconds(seconds: float, slowest: float) -> float:
    """When the stall warning comes, for a timeout and the slowest step."""
    return min(
        seconds / 2,
        max(_WARN_FLOOR_SECONDS, _WARN_SLOWEST_FACTOR * slowest),
    )


def _print(line: str) -> None:
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def _dump_stacks() -> None:
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        fd = 2  # A replaced sys.stderr (e.g. captured): the real one.
    faulthandler.dump_traceback(file=fd, all_threads=True)


def _interrupt(thread_id: int) -> None:
    """Raises KeyboardInterrupt in the loop's thread."""
    if thread_id == threading.main_thread().ident and callable(
        signal.getsignal(signal.SIGINT)
    ):
        # A real signal: it also ends a sleep or a lock wait in progress.
        # Not where SIGINT is ignored (a process started in the background
        # by a non-interactive shell): the signal would be dropped.
        signal.pthread_kill(thread_id, signal.SIGINT)
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(KeyboardInterrupt)
    )


class _Resend:
    """A `sys.unraisablehook` that sends a swallowed interrupt again.

    Python ignores an exception raised where nobody can catch it (a
    garbage-collector or weakref callback, a `__del__`): it hands it to
    `sys.unraisablehook` and goes on. A loop interrupted there would run
    on, so while a fired loop waits for its interrupt this hook sends a
    new one; other unraisable exceptions go to the hook it replaced.
    Installed when the loop is interrupted, removed when the loop leaves.
    """

    def __init__(self, frame: _Frame, previous: Callable[[Any], Any]):
        self.frame = frame
        self.previous = previous

    @classmethod
    def install(cls, frame: _Frame) -> None:
        sys.unraisablehook = cls(frame, sys.unraisablehook)

    @staticmethod
    def remove(frame: _Frame) -> None:
        hook = sys.unraisablehook
        if isinstance(hook, _Resend) and hook.frame is frame:
            sys.unraisablehook = hook.previous
        # Else another hook wraps this one: it stays, and does nothing
        # once the loop has left.

    def __call__(self, unraisable: Any) -> None:
        frame = self.frame
        kind = unraisable.exc_type
        if (
            isinstance(kind, type)
            and issubclass(kind, KeyboardInterrupt)
            and frame in _watchdog.frames
        ):
            frame.lost += 1
            if frame.lost == 1:
                where = unraisable.err_msg or "Exception ignored in"
                _print(
                    f"{HEADER} task {frame.task}: the interrupt landed "
                    f"where Python ignores exceptions ({where}: "
                    f"{unraisable.object!r}); interrupting again."
                )
            # From the watchdog's thread: a signal sent from here would be
            # raised here, inside the hook, and ignored again.
            frame.resend = True
            _watchdog.wake.set()
            return
        self.previous(unraisable)


def _converted(frame: _Frame, error: BaseException | None) -> None:
    """Turns the interrupt of a fired frame into the loop's error."""
    if frame.fired is None or not isinstance(error, KeyboardInterrupt):
        return
    raise RuntimeError(
        f"The hang watchdog stopped this {frame.kind}: no progress for "
        f"{frame.fired_after:.0f} s{' at' if frame.at_step() else ''}"
        f"{frame.at_step()} "
        f"({env.HANG_SECONDS}={frame.seconds:g}). Every thread's stack is "
        "printed above; the interrupted thread's traceback is the cause "
        "below. Fix the hang, or raise the timeout if steps legitimately "
        f"take this long. Received: hang_seconds={frame.seconds:g}"
    ) from error


class watching:  # noqa: N801 - used as a function, like contextlib's
    """Watches one Keras loop (`fit`, `evaluate`, `predict`) for a hang.

    Args:
        strategy: The model's replicator.
        kind: `"fit"`, `"evaluate"` or `"predict"`.
        where: Returns a short position (e.g. `"epoch 3"`) for messages.
    """

    def __init__(
        self,
        strategy: Any,
        kind: str,
        where: Callable[[], str | None] | None = None,
    ):
        self._frame = _Frame(
            kind,
            resolve_seconds(getattr(strategy, "hang_seconds", None)),
            hang_peers.task_of(strategy),
            hang_peers.Cluster.of(strategy),
            where,
        )

    def __enter__(self):
        self._frame.last = time.monotonic()
        _watchdog.push(self._frame)
        return self

    def __exit__(self, kind, error, traceback):
        del kind, traceback
        _watchdog.pop(self._frame)
        _converted(self._frame, error)
        return False


class StepWatch:
    """Watches the calls of one `replicate` step: `with watch: step()`.

    Only the calls are timed; the first one traces and is not.

    Args:
        strategy: The replicator the step runs on.
    """

    def __init__(self, strategy: Any):
        seconds = None
        if traits.is_in_graph(strategy):
            seconds = resolve_seconds(getattr(strategy, "hang_seconds", None))
        self._frame = _Frame(
            "replicate",
            seconds,
            hang_peers.task_of(strategy),
            hang_peers.Cluster.of(strategy),
        )

    def __enter__(self):
        frame = self._frame
        frame.last = time.monotonic()
        frame.thread = threading.get_ident()
        frame.warned = False
        frame.fired = None
        _watchdog.push(frame)
        return self

    def __exit__(self, kind, error, traceback):
        del kind, traceback
        frame = self._frame
        _watchdog.pop(frame)
        if error is None:
            took = time.monotonic() - frame.last
            if frame.armed and took > frame.slowest:
                frame.slowest = took
            frame.steps += 1
            frame.armed = True
        _converted(frame, error)
        return False


class CollectiveWatch:
    """Watches one collective outside the loops: `with watch: ...`.

    E.g. a variable's creation under `MultiWorkerReplicator`, whose initial
    value the chief broadcasts to every worker. Timed from its start, as a
    step; inside a watched loop the loop's own clock covers it.

    Args:
        strategy: The replicator.
        what: What waits, for messages (`"the creation of variable 'x'"`).
    """

    def __init__(self, strategy: Any, what: str):
        self._strategy = strategy
        self._what = what
        self._frame: _Frame | None = None

    def __enter__(self):
        if _watchdog.frames:
            return self
        strategy = self._strategy
        frame = _Frame(
            self._what,
            resolve_seconds(getattr(strategy, "hang_seconds", None)),
            hang_peers.task_of(strategy),
            hang_peers.Cluster.of(strategy),
        )
        frame.stepless = True
        frame.armed = True
        self._frame = frame
        _watchdog.push(frame)
        return self

    def __exit__(self, kind, error, traceback):
        del kind, traceback
        frame, self._frame = self._frame, None
        if frame is not None:
            _watchdog.pop(frame)
            _converted(frame, error)
        return False


def arm() -> None:
    """Notes that the innermost loop's step ran: the first one is traced.

    Called when a step's computation returned, before its callbacks; from
    then on the loop is timed, the first step's callbacks included.
    """
    frames = _watchdog.frames
    if frames and not frames[-1].armed:
        frames[-1].last = time.monotonic()
        frames[-1].armed = True
        _update_backstop()


def beat() -> None:
    """Notes that the innermost watched loop finished a step."""
    frames = _watchdog.frames
    if not frames:
        return
    frame = frames[-1]
    now = time.monotonic()
    if frame.armed and now - frame.last > frame.slowest:
        frame.slowest = now - frame.last
    frame.steps += 1
    frame.last = now
    frame.armed = True
    frame.warned = False
    _update_backstop()


class paused:  # noqa: N801 - used as a function, like contextlib's
    """Stops the clock for a save; other workers learn of it."""

    def __enter__(self):
        if not _watchdog.paused:
            _watchdog.paused_since = time.monotonic()
            _watchdog.paused_wall = time.time()
        _watchdog.paused += 1
        _watchdog.dirty = True
        _watchdog.wake.set()
        _update_backstop()
        return self

    def __exit__(self, kind, error, traceback):
        del kind, error, traceback
        _watchdog.paused -= 1
        _watchdog.resumed_wall = time.time()
        frames = _watchdog.frames
        if frames:
            frames[-1].last = time.monotonic()
            frames[-1].warned = False
        _watchdog.dirty = True
        _watchdog.wake.set()
        _update_backstop()
        return False
