"""Workers die with their launcher, however the launcher dies.

`keras-replicator launch` and `kr.launch` start each worker in its own
process group (Ctrl-C reaches the launcher only; ending a worker ends what
it started). A launcher killed by SIGKILL or a crash would leave them
training as orphans, so each launch first starts this watcher: a child in
a new process group (setsid), reading a pipe on which the launcher names the
groups it starts (`+pid`) and ends (`-pid`), and says `exit` before
closing it. On end-of-file without `exit` the watcher SIGKILLs every group
still named, at once, and exits.

It is this file run as a script (`python -I -S`): stdlib only, about 20 ms
to start. It covers the whole process group (a shell wrapper's children
too), unlike Linux's `PR_SET_PDEATHSIG`, which reaches the direct child.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

_EXIT = "exit"


class Reaper:
    """The launcher's end of the watcher: names the groups to kill.

    A context manager; a normal exit kills nothing. Writes never raise: the
    launch goes on without a watcher that is gone.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            # -I: keep the caller's folder (and a `types.py` there) off
            # sys.path; -S: no site-packages, only the stdlib is needed.
            [sys.executable, "-I", "-S", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            # setsid: signals to the launcher's group miss it.
            start_new_session=True,
        )

    def watch(self, pid: int) -> None:
        """Kill process group `pid` if the launcher dies."""
        self._send(f"+{pid}")

    def forget(self, pid: int) -> None:
        """Process group `pid` is ended (or ending) by the launcher itself."""
        self._send(f"-{pid}")

    def close(self) -> None:
        """Ends the watcher without killing anything."""
        self._send(_EXIT)
        with self._lock, contextlib.suppress(OSError):
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> Reaper:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _send(self, line: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.flush()


def _watch() -> None:
    """The watcher: reads the pipe; kills the named groups on its EOF."""
    groups: set[int] = set()
    buffer = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except InterruptedError:
            continue
        except OSError:
            chunk = b""
        if not chunk:
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if line == _EXIT:
                return
            if line[:1] == "+" and line[1:].isdigit():
                groups.add(int(line[1:]))
            elif line[:1] == "-" and line[1:].isdigit():
                groups.discard(int(line[1:]))
    for group in sorted(groups):
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)


if __name__ == "__main__":
    # Not ended by a Ctrl-C meant for the launcher, even in its terminal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch()
