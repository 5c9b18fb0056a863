"""The fastest layout on one host: one process with N replicas.

N worker processes on one host exchange every gradient all-reduce over
loopback gRPC; one process with N replicas (`kr.LocalReplicator(N)`, what
`kr.auto()` picks without a cluster) sums them in memory. On a 16-core x86
host, 8 CPU replicas in one process trained 1.34x faster than 8 worker
processes (9104 vs 6792 examples/sec, the same conv net and global batch;
`benchmarks/multi_worker_scaling.py`). `keras-replicator launch` starts
every worker on this host, so it says so, with the faster command.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from keras_replicator._src.core import env

# Measured on a 16-core host (issue 19; docs/speed.md).
MEASURED = (
    "8 CPU replicas in one process ran 1.34x the examples/sec of 8 worker "
    "processes on a 16-core host"
)


def launch_hint(
    command: Sequence[str],
    workers: int,
    replicas_per_worker: int | None = None,
    ps: int = 0,
) -> str | None:
    """The `[launch]` line advising one process, or None.

    `keras-replicator launch` runs every worker on this host, where one
    process holding all the replicas avoids gRPC between processes. Only
    synchronous launches get the hint: parameter servers (`ps > 0`) need
    their processes, and one worker is one process already.

    Args:
        command: The command the workers run.
        workers: The number of worker processes.
        replicas_per_worker: CPU replicas per worker, or None for 1 (what
            `MultiWorkerReplicator()` takes on a CPU without
            `KERAS_REPLICATOR_CPU_REPLICAS`).
        ps: Parameter-server tasks.

    Returns:
        One line starting with `[launch]`, or None when there is nothing
        faster to suggest.
    """
    if ps or workers < 2:
        return None
    replicas = workers * (replicas_per_worker or 1)
    faster = f"{env.CPU_REPLICAS}={replicas} {shlex.join(command)}"
    return (
        f"[launch] all {workers} workers run on this host: one process with "
        f"{replicas} replicas is faster (no gRPC between processes; "
        f"{MEASURED}). If the script creates its replicator with "
        f"kr.auto() or kr.LocalReplicator(), run: {faster}  (launch "
        "several workers on one host to test multi-worker code)"
    )
