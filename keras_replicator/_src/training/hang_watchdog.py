"""The hang watchdog: ends a process whose training stops making progress.

A worker alive but stuck (a callback that never returns, a deadlocked input
pipeline) keeps sending TensorFlow's heartbeats, so nothing ends it and the
others wait in their next collective forever. Under `LocalReplicator` and
`MultiWorkerReplicator`, one daemon thread per process (started by the first
watched loop) watches `fit`, `evaluate`, `predict` and `replicate` calls:

- Progress is a batch end whose callbacks returned, or a returned
  `replicate` step call; time between step calls is the caller's, untimed.
- Bounded at `UNTIMED_FACTOR` (5) timeouts only, since a save can itself
  wait in a collective for the stuck worker: every loop's first step
  (tracing, compiling; its callbacks are timed), `BackupAndRestore` and
  `ModelCheckpoint` saves, and other workers' saves, which each publishes
  in TensorFlow's coordination-service key-value store (from this thread,
  never the loop) and reads before it warns or ends.
- After `warn_seconds` (min of half the timeout and max of 60 s and 10
  times the slowest step), a stall warning names this task and step and,
  on several workers, every worker's step, so the laggard is named.
- After `seconds` (`KERAS_REPLICATOR_HANG_SECONDS` or the replicator's
  `hang_seconds`; default 600; 0 is off) it prints task, step and every
  thread's Python stack (`faulthandler`) and exits with `EXIT_CODE` (76),
  which restart policies (`launch --max-restarts`, Kubernetes, Slurm) take
  as "start again" (training resumes from its backup). In an interactive
  process (a notebook kernel, `python -i`) it interrupts the loop's thread
  instead, which raises a `RuntimeError`. An interrupt landing where Python
  ignores exceptions (a GC or weakref callback, `__del__`) is resent at once
  (`_Resend`), and any not acted on every `_RESEND_SECONDS`.
- A preemption signal (`training/preemption.py`) waits for a step end at
  most `warn_seconds` from the signal or a later save's end (first steps
  included; a running save is not cut short), then fires as at the
  timeout. Once acted on, the usual bounds apply.

Per step a loop writes a few attributes and reads the monotonic clock; the
thread wakes about once a second (20 times per timeout under 20 s). Code
holding the GIL forever (a C extension, `ctypes.PyDLL`) stops the thread
(TensorFlow ops and collectives, and Python sleeps and waits, release it),
so a GIL-free backstop (`hang_backstop.py`) fires `backstop_margin` (max of
10 s and half the timeout) after the thread would, letting the thread speak
first when it can. It keeps the thread's bounds, is disarmed within one
wake-up of a loop's end, and only prints in an interactive process. Where
it exits with 1 (not Linux), `launch --max-restarts` restarts as on any
failure.
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
from keras_replicator._src.core import validation
from keras_replicator._src.training import hang_backstop
from keras_replicator._src.training import hang_peers
from keras_replicator._src.training import preemption

# sysexits.h EX_PROTOCOL: "start again" like 75 (EX_TEMPFAIL), but counted
# as a failure, so a run that always hangs stops being restarted.
EXIT_CODE = 76
DEFAULT_SECONDS = 600.0
HEADER = "[keras-replicator watchdog]"
# Stall warning: min(timeout / 2, max(floor, factor * slowest step)).
_WARN_FLOOR_SECONDS = 60.0
_WARN_SLOWEST_FACTOR = 10.0
# How long a warning waits for other workers to publish their step.
_SETTLE_SECONDS = 5.0
# A notebook loop stuck this long after its interrupt is inside TensorFlow.
_INTERRUPT_NOTE_SECONDS = 30.0
# Resend an unheeded interrupt (`except BaseException` may eat it) after
# this, enough to unwind; one stuck in TensorFlow keeps just one pending.
_RESEND_SECONDS = 5.0
# Bound, in timeouts, on what is untimed (first step, saves): a save can
# wait forever in a collective for the stuck worker.
UNTIMED_FACTOR = 5
# The backstop fires max(floor, fraction * timeout) after the thread would.
_BACKSTOP_FLOOR_SECONDS = 10.0
_BACKSTOP_FRACTION = 0.5
_OFF = ("0", "off", "none", "")


def resolve_seconds(setting: float | None = None) -> float | None:
    """The timeout in seconds, or None when off.

    `setting` (a replicator's `hang_seconds`: 0 is off), else
    `KERAS_REPLICATOR_HANG_SECONDS`, else 600. Raises ValueError if the
    variable is not a non-negative number or "off".
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
    """Raises ValueError unless `value` is None, 0 or positive and finite."""
    if value is not None and not (
        validation.is_number(value) and 0 <= value < math.inf
    ):
        raise ValueError(
            f"`{name}` must be None (read `{env.HANG_SECONDS}`, default "
            f"{DEFAULT_SECONDS:g}), 0 (off) or a positive number of seconds. "
            f"Received: {name}={value!r}"
        )


def interactive() -> bool:
    """Whether this is a notebook kernel or `python -i` (raise, not exit)."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    return get is not None and get() is not None


class _Frame:
    """One watched loop, or one collective outside the loops (`stepless`)."""

    def __init__(self, kind, strategy, where=None, timed=True):
        self.kind = kind
        self.stepless = False
        setting = getattr(strategy, "hang_seconds", None)
        self.seconds = resolve_seconds(setting) if timed else None
        self.task = hang_peers.task_of(strategy)
        self.cluster = hang_peers.Cluster.of(strategy)
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
            # A new timeout (rare): start the thread or check more often.
            self.basis = frame.seconds
            self.start()
            self.wake.set()
        _update_backstop()

    def pop(self, frame: _Frame) -> None:
        # Under the send lock: no interrupt is sent to a loop that left.
        with self.send_lock:
            try:
                self.frames.remove(frame)
            except ValueError:
                return
        if frame.fired is not None:
            _Resend.remove(frame)
        if self.frames:
            # Restart the enclosing loop's clock (fit's, after validation).
            outer = self.frames[-1]
            outer.last = time.monotonic()
            outer.warned = False
            _update_backstop()
        # No loop left: the backstop stays armed until the thread disarms
        # it; rearming per `replicate` call costs two thread starts.

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
                # Another worker saves or saved since our last step.
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

        A step that never ends (a deadlocked collective) would keep the
        process deaf to SIGTERM until the timeout (five, in a first step).
        With a signal pending the bound is `warn_seconds`, from the signal
        or the last progress after it, first steps included. A running save
        is not cut short: that would lose the backup it writes.
        """
        since = preemption.pending_since()
        if since is None or self.paused:
            return False
        idle = now - max(since, frame.last)
        bound = warn_seconds(frame.seconds, frame.slowest)
        if idle < bound:
            return False
        name = preemption.signal_name(preemption.pending())
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
        faulthandler.dump_traceback(
            file=hang_backstop.stderr_fd(), all_threads=True
        )
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
        """Interrupts fired `frame` if running and last sent `after` s ago."""
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

    The deadline is the thread's (the timeout after the last progress, or
    `UNTIMED_FACTOR` timeouts into a first step or save). With no timed
    loop only the thread (`disarm`) disarms it.
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
        seconds / 2, max(_WARN_FLOOR_SECONDS, _WARN_SLOWEST_FACTOR * slowest)
    )


def _print(line: str) -> None:
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def _interrupt(thread_id: int) -> None:
    """Raises KeyboardInterrupt in the loop's thread."""
    if thread_id == threading.main_thread().ident and callable(
        signal.getsignal(signal.SIGINT)
    ):
        # A signal also ends a sleep or lock wait; not where SIGINT is
        # ignored (backgrounded by a non-interactive shell): it is dropped.
        signal.pthread_kill(thread_id, signal.SIGINT)
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(KeyboardInterrupt)
    )


class _Resend:
    """A `sys.unraisablehook` that resends a swallowed interrupt.

    Python hands exceptions nobody can catch (GC or weakref callbacks,
    `__del__`) to `sys.unraisablehook` and goes on, so an interrupt landing
    there is lost. Others go to the replaced hook. Installed when a loop is
    interrupted, removed when it leaves.
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
        # Else another hook wraps it: it stays, inert once the loop left.

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
            # Via the watchdog's thread: sent here, it is ignored again.
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
    """Watches one Keras loop (`kind`: fit, evaluate, predict) for a hang.

    `where` returns a short position for messages (e.g. `"epoch 3"`).
    """

    def __init__(
        self,
        strategy: Any,
        kind: str,
        where: Callable[[], str | None] | None = None,
    ):
        self._frame = _Frame(kind, strategy, where)

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
    """Watches one `replicate` step's calls: `with watch: step()`.

    Only the calls are timed, except the first, which traces.
    """

    def __init__(self, strategy: Any):
        timed = traits.is_in_graph(strategy)
        self._frame = _Frame("replicate", strategy, timed=timed)

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

    E.g. creating a variable under `MultiWorkerReplicator` (the chief
    broadcasts its initial value). Timed as a step; inside a watched loop
    the loop's clock covers it. `what` names it in messages.
    """

    def __init__(self, strategy: Any, what: str):
        self._strategy = strategy
        self._what = what
        self._frame: _Frame | None = None

    def __enter__(self):
        if _watchdog.frames:
            return self
        frame = _Frame(self._what, self._strategy)
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
    """Starts timing the innermost loop once its traced first step ran.

    Called before the step's callbacks, which are timed.
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
