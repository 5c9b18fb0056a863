"""Bounds how long a worker waits for its peers when the cluster starts.

When a peer never comes up (crashed, wrong address, firewalled port),
TensorFlow's multi-worker start-up blocks forever in C++
(`context.ensure_initialized`), holding the GIL and ignoring SIGTERM; no
thread can interrupt it. So a watchdog child process, after
`timeout_seconds`, probes every peer, prints the tasks it could not reach
and SIGKILLs the stuck process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence


def unreachable(
    cluster: Mapping[str, Sequence[str]], me: str, probe_seconds: float = 2.0
) -> list[str]:
    """The `job:index at host:port` of peers that refuse TCP connections."""
    lost = []
    for job in sorted(cluster):
        for index, address in enumerate(cluster[job]):
            if address != me and refuses_connections(address, probe_seconds):
                lost.append(f"{job}:{index} at {address}")
    return lost


def refuses_connections(address: str, probe_seconds: float = 2.0) -> bool:
    """Whether `host:port` refuses (or does not answer) a TCP connection."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection(
            (host.strip("[]"), int(port)), timeout=probe_seconds
        ):
            return False
    except OSError:
        return True


def message(lost: Sequence[str], timeout_seconds: float, me: str) -> str:
    """The error printed when start-up times out."""
    who = ", ".join(lost) if lost else "(every address accepts connections)"
    return (
        f"keras_replicator: the multi-worker cluster did not start within "
        f"{timeout_seconds:g} s (timeout_seconds). This task ({me}) could "
        f"not reach: {who}. Check that every worker was started, with the "
        "same cluster spec, and that these addresses are reachable from "
        "here. Ending this process (SIGKILL), which TensorFlow would "
        "otherwise keep waiting forever."
    )


@contextlib.contextmanager
def bounded_startup(
    cluster: Mapping[str, Sequence[str]], me: str, timeout_seconds: float | None
) -> Iterator[None]:
    """Ends the process if the body (the start-up) outlasts `timeout_seconds`.

    `cluster` maps jobs to addresses as in TF_CONFIG; `me`, this task's
    address, is not probed. A None timeout disables the watchdog.
    """
    if timeout_seconds is None:
        yield
        return
    # An absolute deadline, fixed here: the child's own start-up time must
    # not stretch the bound.
    deadline = time.time() + timeout_seconds
    spec = json.dumps(
        [os.getpid(), deadline, timeout_seconds, dict(cluster), me]
    )
    # This file as a stdlib-only script: importing the package would import
    # TensorFlow, seconds of CPU on every worker start.
    watchdog = subprocess.Popen(
        # -I: keep this file's folder (with our types.py) off sys.path.
        [sys.executable, "-I", os.path.abspath(__file__), spec],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield
    finally:
        watchdog.kill()
        watchdog.wait()


def _watch(spec: str) -> None:
    """The child: waits, then probes, reports and kills the parent."""
    parent, deadline, timeout_seconds, cluster, me = json.loads(spec)
    while time.time() < deadline:
        time.sleep(min(0.5, max(0.0, deadline - time.time())))
        if os.getppid() != parent:  # The parent is gone: nothing to do.
            return
    lost = unreachable(cluster, me)
    print(message(lost, timeout_seconds, me), file=sys.stderr, flush=True)
    os.kill(parent, signal.SIGKILL)


if __name__ == "__main__":
    _watch(sys.argv[1])
