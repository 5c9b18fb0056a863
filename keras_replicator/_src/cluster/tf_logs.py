"""Keeps TensorFlow's C++ start-up logs out of the `keras-replicator` commands.

On a CPU machine, importing TensorFlow 2.21 and listing its devices writes
up to nine lines to stderr: absl's "All log messages before
absl::InitializeLog() is called are written to STDERR", the oneDNN notice,
"Could not find cuda drivers" (cudart_stub), the cpu_feature_guard notice
and "failed call to cuInit". `TF_CPP_MIN_LOG_LEVEL=3`, set before TensorFlow
loads, hides the last two and every later C++ log below FATAL; the first
three are written while TensorFlow's libraries load, before that setting
applies, because absl writes every message to stderr until
`absl::InitializeLog()` is called, which TensorFlow never does
(abseil/abseil-cpp#1718, tensorflow/tensorflow#100442). Those lines carry
the timestamp absl writes before its initialisation (`I0000 00:00:<unix
seconds>`), which Python's absl logging never writes, so they are filtered
out by their format (`StartupLogFilter`).

The commands (`demo`, `env`, `launch` and the workers it starts) hide them
unless `--verbose` is given or the user set `TF_CPP_MIN_LOG_LEVEL`
(`quiet_wanted`). So does a process that another launcher started as one
of a job's processes (`mpiexec`, `srun`, or a `TF_CONFIG` of several
tasks, as Kubernetes sets) when it imports `keras_replicator` before
TensorFlow (`quiet_launched_process`): every rank would otherwise print
the start-up logs, and TensorFlow's coordination service an INFO line for
every barrier (the library's saves pass several). A single-process
program that imports `keras_replicator` is left alone.

TensorFlow-free.
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

    Args:
        verbose: Whether `--verbose` was given.
        environ: The environment. Defaults to `os.environ`.

    Returns:
        True unless `verbose`, or `TF_CPP_MIN_LOG_LEVEL` is set (the user's
        own choice of level is kept, and their logs shown).
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

    Import TensorFlow inside the block. Everything written to file
    descriptor 2 meanwhile (C++ code writes there, not to `sys.stderr`) is
    held in a temporary file, then written to stderr without the start-up
    log lines, so Python warnings and errors of the import still show.
    Set `TF_CPP_MIN_LOG_LEVEL` before the block: it hides the logs that
    come later.

    Yields:
        None.
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

    Called by `keras_replicator/__init__.py` before it imports TensorFlow.
    Only when this process is one of a job's (`launched`), TensorFlow is
    not imported yet (then it is too late) and the user did not set
    `TF_CPP_MIN_LOG_LEVEL`: it sets that to `QUIET_LEVEL`, as `keras-
    replicator launch` does for its workers, and imports TensorFlow with
    the start-up lines dropped.
    """
    if "tensorflow" in sys.modules or not quiet_wanted() or not launched():
        return
    os.environ[LEVEL_ENV] = QUIET_LEVEL
    with hidden_startup_logs():
        import tensorflow  # noqa: F401
