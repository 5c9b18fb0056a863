"""The fastest layout on one host: one process with N replicas.

N worker processes on one host exchange every gradient all-reduce over
loopback gRPC; one process with N replicas (`kr.LocalReplicator(N)`, what
`kr.auto()` picks without a cluster) sums them in memory. On a 16-core x86
host, 8 CPU replicas in one process trained 1.34x faster than 8 worker
processes (9104 vs 6792 examples/sec, the same conv net and global batch;
`benchmarks/multi_worker_scaling.py`).

Who says so, and when: the chief of a `keras-replicator launch` (which
starts every worker on this host), in one line, when the script builds a
`MultiWorkerReplicator` itself (`kr.MultiWorkerReplicator()`, `kr.auto()`).
Only the worker knows that: the launcher runs any command. Under
`keras.distribution` (`initialize()` builds the replicator, inside
`for_keras_distribution`) several processes can be the point, a
`ModelParallel` mesh with one device per process, so nothing is said;
nor under parameter servers (their processes are the design), nor by
`kr.launch` (its workers are the test of multi-worker code it exists for).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import threading
from collections.abc import Sequence

from keras_replicator._src.core import env

# Measured on a 16-core host (issue 19; docs/speed.md).
MEASURED = (
    "8 CPU replicas in one process ran 1.34x the examples/sec of 8 worker "
    "processes on a 16-core host"
)

_state = threading.local()
# Once per process: notebooks and scripts build replicators again and again.
_advised = False


@contextlib.contextmanager
def for_keras_distribution():
    """While open (on this thread), a replicator built is Keras'.

    `keras.distribution.initialize()` builds its process's replicator in
    this block, so the one-process advice stays out of its runs.
    """
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def one_process_advice(
    workers: int,
    replicas_per_worker: int,
    device_type: str,
    argv: Sequence[str],
) -> str:
    """The one line advising one process with every replica.

    Args:
        workers: Worker processes on this host.
        replicas_per_worker: Replicas each of them holds.
        device_type: `"CPU"` or `"GPU"`.
        argv: The script and its arguments (`sys.argv`).

    Returns:
        One line, the command to run included.
    """
    replicas = workers * replicas_per_worker
    command = shlex.join(["python", *argv])
    if device_type == "CPU":
        command = f"{env.CPU_REPLICAS}={replicas} {command}"
    return (
        f"keras-replicator: {workers} worker processes on this host; one "
        f"process with all {replicas} replicas is faster (no gRPC between "
        f"processes; {MEASURED}). If this script builds its replicator with "
        f"kr.auto() or kr.LocalReplicator(), run: {command}"
    )


def advise_once(config, device_type: str, count: int) -> None:
    """Prints `one_process_advice` on the chief of a one-host launch.

    Called by `MultiWorkerReplicator()`. Prints only in a worker that
    `keras-replicator launch` started (`KERAS_REPLICATOR_LAUNCHED`), on the
    chief, with at least 2 workers, outside `for_keras_distribution`, and
    once per process.

    Args:
        config: The replicator's `ClusterConfig`.
        device_type: `"CPU"` or `"GPU"`: what its replicas run on.
        count: Its replicas in this process.
    """
    global _advised
    if (
        _advised
        or getattr(_state, "depth", 0)
        or os.environ.get(env.LAUNCHED) != "1"
        or config.num_workers < 2
        or not config.is_chief
    ):
        return
    _advised = True
    line = one_process_advice(config.num_workers, count, device_type, sys.argv)
    print(line, file=sys.stderr, flush=True)
