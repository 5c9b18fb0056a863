"""What a `kr.launch` process runs: the caller's function, once.

Started by `notebook_launch.launch` (`python -m
keras_replicator._src.cluster.launch_worker`, `TF_CONFIG` set), it calls
the pickled `(fn, args, kwargs)` in file `KERAS_REPLICATOR_LAUNCH_PAYLOAD`
and atomically writes `("ok", pickled value)` or `("error", pickled
exception or None, traceback text)` to file `KERAS_REPLICATOR_LAUNCH_RESULT`.
The caller holds stdin open, unwritten: at its EOF (the caller died, e.g. a
killed notebook kernel) this process ends itself.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import traceback

import cloudpickle

from keras_replicator._src.core import env

# Exit code when the caller went away.
_ORPHANED = 75


def _end_when_caller_dies() -> None:
    def watch():
        # Raw fd: a daemon thread blocked in sys.stdin's buffered reader
        # holds its lock, a fatal error at interpreter exit.
        try:
            while os.read(fd, 1024):
                pass
        except OSError:
            pass
        os._exit(_ORPHANED)

    fd = sys.stdin.fileno()

    threading.Thread(target=watch, daemon=True, name="kr-parent-watch").start()


def _write(path: str, record: tuple) -> None:
    partial = f"{path}.partial"
    with open(partial, "wb") as f:
        pickle.dump(record, f)
    os.replace(partial, path)


def _picklable(error: BaseException) -> bytes | None:
    try:
        blob = cloudpickle.dumps(error)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - any failure means "send text only"
        return None
    return blob


def main() -> int:
    """Runs the payload; returns the process exit code."""
    _end_when_caller_dies()
    result_path = os.environ[env.LAUNCH_RESULT]
    with open(os.environ[env.LAUNCH_PAYLOAD], "rb") as f:
        fn, args, kwargs = pickle.load(f)
    try:
        value = fn(*args, **kwargs)
        record = ("ok", cloudpickle.dumps(value))
    except BaseException as error:  # noqa: BLE001 - reported to the caller
        record = ("error", _picklable(error), traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    _write(result_path, record)
    return 0 if record[0] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
