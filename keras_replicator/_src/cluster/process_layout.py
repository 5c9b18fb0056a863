"""The fastest layout on one host: one process with N replicas.

N worker processes on one host all-reduce over loopback gRPC; one process
with N replicas (`kr.LocalReplicator(N)`, `kr.auto()` without a cluster)
sums in memory. On a 16-core x86 host, 8 CPU replicas in one process
trained 1.34x faster than 8 worker processes (9104 vs 6792 examples/sec,
same conv net and global batch; `benchmarks/multi_worker_scaling.py`).

The chief of a `keras-replicator launch` says so in one line when the
script builds a `MultiWorkerReplicator` itself; only the worker knows that
(the launcher runs any command). Silent under `keras.distribution`
(`for_keras_distribution`: a `ModelParallel` mesh of one device per process
can be the point), parameter servers (their processes are the design) and
`kr.launch` (its workers test multi-worker code).
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

    `keras.distribution.initialize()` builds in it: no one-process advice.
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
    """The one line advising one process with every replica, and its command.

    `workers` on this host hold `replicas_per_worker` each, of
    `device_type` `"CPU"` or `"GPU"`; `argv` is the script's `sys.argv`.
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

    Called by `MultiWorkerReplicator()` with its `ClusterConfig`, replica
    `device_type` and `count` here. Prints once per process, only on the
    chief of a `keras-replicator launch` (`KERAS_REPLICATOR_LAUNCHED`) of
    at least 2 workers, outside `for_keras_distribution`.
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
