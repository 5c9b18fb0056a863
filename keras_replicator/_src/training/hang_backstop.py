"""The hang watchdog's backstop: it fires even when no Python thread can run.

Code that blocks holding the GIL (a C extension, a `ctypes.PyDLL` call, a
deadlocked library) starves the watchdog's Python thread, and a single
process has no peer to notice. The backstop needs no GIL, Python thread or
peer: `faulthandler.dump_traceback_later`'s C thread prints every Python
stack to stderr under a `Timeout (H:MM:SS)!` header, and a few seconds later
a POSIX timer (`timer_create`, `SIGEV_THREAD`) calls `_exit(76)`
(`hang_watchdog.EXIT_CODE`) from a new C thread. Without such timers (only
Linux is supported; macOS has none) `faulthandler` exits itself with 1.

The watchdog sets the deadline later than its own and moves it as steps
finish; arming starts a thread, so a deadline moving later by under `slack`
stays. In an interactive process it only prints. While a watched loop runs,
it replaces a program's own use of the process's one
`faulthandler.dump_traceback_later`.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import os
import sys
import threading
import time

# Seconds between the stacks and the exit: time to write them.
EXIT_DELAY_SECONDS = 3.0
# faulthandler's exit code (`_exit(1)`), where no POSIX timer exits with ours.
FAULTHANDLER_EXIT_CODE = 1
_CLOCK_MONOTONIC = 1
_SIGEV_THREAD = 2


class _Sigevent(ctypes.Structure):
    """Linux's `struct sigevent` (64 bytes) with its `SIGEV_THREAD` fields."""

    _fields_ = (
        # `union sigval`, passed by value: the notify function's int arg.
        ("value", ctypes.c_void_p),
        ("signo", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("function", ctypes.c_void_p),
        ("attributes", ctypes.c_void_p),
        ("pad", ctypes.c_byte * (64 - 16 - 2 * ctypes.sizeof(ctypes.c_void_p))),
    )


class _Timespec(ctypes.Structure):
    _fields_ = (("sec", ctypes.c_long), ("nsec", ctypes.c_long))


class _Itimerspec(ctypes.Structure):
    _fields_ = (("interval", _Timespec), ("value", _Timespec))


class _ExitTimer:
    """A POSIX timer calling `_exit(code)` from a new C thread; else OSError."""

    def __init__(self, code: int):
        if not sys.platform.startswith("linux"):
            raise OSError(f"no SIGEV_THREAD timers on {sys.platform}")
        libc = ctypes.CDLL(None, use_errno=True)
        create = getattr(libc, "timer_create", None)
        if create is None:  # glibc before 2.34 keeps timers in librt.
            libc = ctypes.CDLL("librt.so.1", use_errno=True)
            create = libc.timer_create
        self._settime = libc.timer_settime
        event = _Sigevent()
        event.value = code
        event.notify = _SIGEV_THREAD
        event.function = ctypes.cast(
            ctypes.CDLL(None)._exit, ctypes.c_void_p
        ).value
        self._timer = ctypes.c_void_p()
        if create(
            _CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(self._timer)
        ):
            raise OSError(ctypes.get_errno(), "timer_create failed")

    def set(self, seconds: float) -> None:
        """Expires in `seconds` (> 0); 0 disarms."""
        whole = int(seconds)
        nanos = int((seconds - whole) * 1e9)
        if seconds > 0 and whole == 0 and nanos == 0:
            nanos = 1
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(whole, nanos))
        self._settime(self._timer, 0, ctypes.byref(spec), None)


class _Backstop:
    def __init__(self):
        self.lock = threading.Lock()
        # Monotonic time of the armed dump (None: unarmed); `ends`: exits.
        self.at: float | None = None
        self.ends = False
        self.timer: _ExitTimer | None = None
        self.tried = False

    def exit_timer(self, code: int) -> _ExitTimer | None:
        if not self.tried:
            self.tried = True
            try:
                self.timer = _ExitTimer(code)
            except (OSError, AttributeError):
                self.timer = None
        return self.timer

    def reset_after_fork(self) -> None:
        # Neither faulthandler's thread nor POSIX timers survive a fork.
        self.lock = threading.Lock()
        self.at = None
        self.timer = None
        self.tried = False


_backstop = _Backstop()


def arm(at: float, slack: float, ends: bool, code: int) -> None:
    """Prints every stack at monotonic time `at`, then exits with `code`.

    An armed deadline up to `slack` earlier than `at` is kept (arming starts
    a thread). With `ends`, the process exits `EXIT_DELAY_SECONDS` later
    (with 1, faulthandler's, where there is no POSIX timer).
    """
    with _backstop.lock:
        armed = _backstop.at
        if (
            armed is not None
            and ends == _backstop.ends
            and armed <= at <= armed + slack
        ):
            return
        timer = _backstop.exit_timer(code) if ends else None
        seconds = max(at - time.monotonic(), 0.001)
        faulthandler.dump_traceback_later(
            seconds,
            file=stderr_fd(),
            # Without a timer, faulthandler ends the process itself.
            exit=ends and timer is None,
        )
        if _backstop.timer is not None:
            _backstop.timer.set(seconds + EXIT_DELAY_SECONDS if timer else 0)
        _backstop.at, _backstop.ends = at, ends


def cancel() -> None:
    """Disarms the backstop, if armed."""
    with _backstop.lock:
        if _backstop.at is None:
            return
        faulthandler.cancel_dump_traceback_later()
        if _backstop.timer is not None:
            _backstop.timer.set(0)
        _backstop.at = None


def armed_at() -> float | None:
    """When (`time.monotonic()`) the armed backstop fires, or None."""
    return _backstop.at


def stderr_fd() -> int:
    """The file descriptor of standard error, for `faulthandler`."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2  # A replaced sys.stderr (e.g. captured): the real one.


# A deadline must not end a process during its normal shutdown.
atexit.register(cancel)
os.register_at_fork(after_in_child=_backstop.reset_after_fork)
