"""Parameter-server failures under AsyncReplicator, named as such.

TF reports a dead parameter server as an `UnavailableError` deep in a gRPC
message, or as an error naming no task; both become a `ParameterServerError`
naming the server.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import tensorflow as tf

from keras_replicator._src.cluster import config as cluster_lib
from keras_replicator._src.cluster import startup_watchdog
from keras_replicator._src.upstream import pythonify_logs


class ParameterServerError(RuntimeError):
    """A parameter server died: its variables are gone, training stopped.

    Raised by `model.fit`/`evaluate` and replicated steps under
    `AsyncReplicator`; the message names the server and the fix (restart
    from the last checkpoint).
    """


def is_ps_failure(error: BaseException) -> bool:
    """Whether a step's error says a parameter server is unreachable."""
    return isinstance(
        error, (tf.errors.UnavailableError, tf.errors.AbortedError)
    ) and ("/job:ps" in str(error))


@contextlib.contextmanager
def clear_ps_errors(
    config: cluster_lib.ClusterConfig | None = None,
) -> Iterator[None]:
    """Turns a parameter-server failure into a `ParameterServerError`.

    The server's variables are lost, so no retry can help. `config`, if
    given, names the dead server's address.
    """
    try:
        yield
    except tf.errors.OpError as e:
        if is_ps_failure(e):
            match = re.search(r"/job:ps/replica:\d+/task:(\d+)", str(e))
            task = f"/job:ps/task:{match.group(1)}" if match else "/job:ps"
            if match and config is not None:
                task += f" ({config.cluster['ps'][int(match.group(1))]})"
        elif isinstance(e, _MAYBE_PS_FAILURE) and config is not None:
            # A dead server may surface as e.g. an OutOfRangeError naming no
            # task (seen here). Ask the servers.
            task = _unreachable_ps(config)
            if task is None:
                raise
        else:
            raise
        raise ParameterServerError(
            f"Parameter server {task} stopped responding, so the variables "
            "it held are lost and training cannot continue. Restart the "
            "cluster and restore the last checkpoint (e.g. with "
            "keras.callbacks.BackupAndRestore). TensorFlow reported: "
            f"{type(e).__name__}: {_ps_line(e)}"
        ) from e


def fetch_logs(result) -> dict:
    """Fetches a step's `RemoteValue` as Python logs, tolerating lost workers.

    A worker that died after its step took the outputs along, but the update
    is on the parameter servers: return `{}` rather than fail. Step and
    parameter-server errors propagate.
    """
    try:
        return pythonify_logs(result.fetch())
    except (
        tf.errors.UnavailableError,
        tf.errors.AbortedError,
        tf.errors.CancelledError,
    ) as e:
        if is_ps_failure(e):
            raise
        return {}


# Errors a step can end with when a parameter server dies mid-step.
_MAYBE_PS_FAILURE = (
    tf.errors.OutOfRangeError,
    tf.errors.CancelledError,
    tf.errors.UnknownError,
    tf.errors.InternalError,
)


def _unreachable_ps(config: cluster_lib.ClusterConfig) -> str | None:
    """The first ps task refusing connections, as "/job:ps/task:i (addr)"."""
    for index, address in enumerate(config.cluster.get("ps", ())):
        if startup_watchdog.refuses_connections(address):
            return f"/job:ps/task:{index} ({address})"
    return None


def _ps_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "/job:ps" not in line and "error" not in line.lower():
            return line[:200]
    return lines[0][:200] if lines else ""
