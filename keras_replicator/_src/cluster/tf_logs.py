"""Keeps TensorFlow's C++ start-up logs out of the `keras-replicator` commands.

On CPU, importing TensorFlow 2.21 and listing devices writes up to nine
stderr lines: absl's "All log messages before absl::InitializeLog() is called
are written to STDERR", the oneDNN notice, "Could not find cuda drivers"
(cudart_stub), the cpu_feature_guard notice and "failed call to cuInit".
`TF_CPP_MIN_LOG_LEVEL=3`, set before TensorFlow loads, hides the last two and
every later C++ log below FATAL. The first three come while TensorFlow's
libraries load, before that applies: absl writes everything to stderr until
`absl::InitializeLog()`, which TensorFlow never calls (abseil/abseil-cpp#1718,
tensorflow/tensorflow#100442). They carry absl's pre-initialisation timestamp
(`I0000 00:00:<unix seconds>`), which Python's absl never writes, so
`StartupLogFilter` drops them by their format.

The commands (`demo`, `env`, `launch` and its workers) hide them unless
`--verbose` is given or `TF_CPP_MIN_LOG_LEVEL` is set (`quiet_wanted`). So
does a process of a job another launcher started (`mpiexec`, `srun`, or a
multi-task `TF_CONFIG` as Kubernetes sets) that imports `keras_replicator`
before TensorFlow (`quiet_launched_process`): else every rank prints them,
and TensorFlow's coordination service an INFO line per barrier (the library's
saves pass several). Single-process programs are left alone. TensorFlow-free.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from collections.abc import Mapping

LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
# FATAL only: what the quiet commands set.
QUIET_LEVEL = "3"
# An absl C++ log line written before `absl::InitializeLog()`:
# `I0000 00:00:1795696317.909375    6487 port.cc:153] oneDNN custom ...`.
_STARTUP_LINE = re.compile(r"^[IWE]0000 00:00:\d+\.\d+\s+\d+ \S+:\d+\] ")
_ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog()"
# cpu_feature_guard's notice goes on over a second, unprefixed line.
_CONTINUATION = "To enable the following instructions:"


def quiet_wanted(
    verbose: bool = False, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether a command should hide TensorFlow's C++ logs.

    True unless `verbose` (`--verbose`) or `environ` (default `os.environ`)
    sets `TF_CPP_MIN_LOG_LEVEL`: the user's own level is kept.
    """
    environ = os.environ if environ is None else environ
    return not verbose and LEVEL_ENV not in environ


class StartupLogFilter:
    """Tells TensorFlow's start-up log lines from the rest of an output.

    One filter per stream: a line that continues a dropped log line is
    dropped with it.
    """

    def __init__(self):
        self._dropped_last = False

    def keep(self, line: str) -> bool:
        """Whether `line` (without its newline) is not a start-up log line."""
        drop = (
            line.startswith(_ABSL_BANNER)
            or _STARTUP_LINE.match(line) is not None
            or (self._dropped_last and line.startswith(_CONTINUATION))
        )
        self._dropped_last = drop
        return not drop


@contextlib.contextmanager
def hidden_startup_logs() -> Iterator[None]:
    """Drops TensorFlow's start-up log lines from this process's stderr.

    Import TensorFlow inside the block, with `TF_CPP_MIN_LOG_LEVEL` set before
    it (for the later logs). File descriptor 2, where C++ code writes, goes to
    a temporary file meanwhile, then to stderr without the start-up lines, so
    the import's Python warnings and errors still show.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                held.seek(0)
                startup = StartupLogFilter()
                for raw in held:
                    line = raw.decode(errors="replace")
                    if startup.keep(line.rstrip("\r\n")):
                        sys.stderr.write(line)
                sys.stderr.flush()
    finally:
        os.close(saved)


# What a launcher other than ours sets in each process of a job.
_LAUNCHED_VARS = (
    "PMI_RANK",
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "SLURM_PROCID",
)


def launched(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one of a multi-process job's.

    Started by mpiexec or srun (their rank variables), or given a
    `TF_CONFIG` whose cluster holds more than one task.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _LAUNCHED_VARS):
        return True
    config = environ.get("TF_CONFIG", "")
    if not config:
        return False
    import json

    try:
        cluster = json.loads(config).get("cluster", {})
    except (ValueError, AttributeError):
        return False  # The replicator reports a malformed TF_CONFIG.
    return sum(len(tasks) for tasks in cluster.values()) > 1


def quiet_launched_process() -> None:
    """Hides TensorFlow's C++ logs in one process of a multi-process job.

    Called by `keras_replicator/_src/__init__.py`. Only in a job's process
    (`launched`), before TensorFlow is imported, and if the user did not set
    `TF_CPP_MIN_LOG_LEVEL`: sets it to `QUIET_LEVEL`, as `launch` does for its
    workers, and imports TensorFlow with the start-up lines dropped.
    """
    if "tensorflow" in sys.modules or not quiet_wanted() or not launched():
        return
    os.environ[LEVEL_ENV] = QUIET_LEVEL
    with hidden_startup_logs():
        import tensorflow  # noqa: F401
