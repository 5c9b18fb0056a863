"""Starts worker processes with TensorFlow and Keras already imported.

A worker spends most of its CPU time on `import tensorflow` and `import
keras` (about 6 s of 2 cores' time each on the test machine), and the
multi-worker tests start hundreds of workers. This server imports them
once, then forks one worker per request: a worker is the same script,
argv, environment, working directory and output as `python script`, in a
process of its own session, that has paid nothing for the imports.

Used by `harness.run_workers` (`KERAS_REPLICATOR_TEST_ZYGOTE=0` turns it
off). It is a test tool, not part of the package.

Why a fork is safe here: this process imports TensorFlow, Keras and
keras_replicator, and nothing more; it creates no TensorFlow context, no
device, no session, no gRPC server and no Python thread, so a worker
starts TensorFlow's runtime as a fresh process does. What is read at
import time (TensorFlow's C++ log level, oneDNN) is fixed by the server's
environment: a worker whose environment differs there is started the
usual way (`harness._zygote_can_start`).

Protocol, over a Unix socket: the client sends one JSON request (argv: a
script and its arguments, or `-c`, code and arguments; env; cwd) with its
stdin, stdout and stderr as file descriptors (`socket.send_fds`). The
server forks a supervisor for the connection, which forks the worker,
replies `{"pid": P}`, waits for it, and replies `{"status": S}`: the exit
code, or minus the signal that killed it, as `subprocess.Popen.returncode`
says.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import tempfile
import types

# Imported once here, for every worker.
import keras  # noqa: F401
import numpy as np
import tensorflow  # noqa: F401

import keras_replicator  # noqa: F401

_PR_SET_PDEATHSIG = 1
# The server's own PYTHONPATH: a worker's may differ (`_python_path`).
_OWN_PYTHONPATH = os.environ.get("PYTHONPATH", "")


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _run_worker(request: dict, fds: list[int]) -> None:
    """In the forked worker: becomes `python argv...`, then exits."""
    os.setsid()
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = request["argv"]
    if argv[0] == "-c":
        script = None
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
    else:
        script = os.path.abspath(argv[0])
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(script)
    # As a fresh process: its own NumPy global seed (Python's `random`
    # reseeds itself after a fork).
    np.random.seed()
    _python_path(request["env"].get("PYTHONPATH", ""))
    # Read from TMPDIR again: the imports cached the server's.
    tempfile.tempdir = None
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    import runpy
    import threading
    import traceback

    code = 0
    try:
        if script is None:
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter does
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code & 0xFF)


def _python_path(wanted: str) -> None:
    """Makes `sys.path` what the worker's PYTHONPATH would have made it.

    The server's PYTHONPATH entries (the repository) leave `sys.path`, and
    the modules imported from there (this `tests` package) leave
    `sys.modules`, so a worker without the repository on its path cannot
    import what a fresh `python` could not. The package itself stays: it is
    installed, and the same files.
    """
    if wanted == _OWN_PYTHONPATH:
        return
    own = [p for p in _OWN_PYTHONPATH.split(os.pathsep) if p]
    sys.path[1:] = [p for p in sys.path[1:] if p not in own]
    sys.path[1:1] = [p for p in wanted.split(os.pathsep) if p]
    for name in list(sys.modules):
        if name == "tests" or name.startswith("tests."):
            del sys.modules[name]


def _supervise(conn: socket.socket) -> None:
    """In the forked supervisor: starts the worker, reports its end."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, new_fds, _, _ = socket.recv_fds(conn, 1 << 20, 8)
        if not chunk:
            os._exit(1)
        data += chunk
        fds += new_fds
    request = json.loads(data)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run_worker(request, fds)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    _, status = os.waitpid(pid, 0)
    _send(conn, {"status": os.waitstatus_to_exitcode(status)})
    os._exit(0)


def main(path: str) -> None:
    _die_with_parent()
    # Supervisors are reaped as they end.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        # (A fork clears the parent-death signal: a supervisor outlives the
        # server only to report its worker's end.)
        if os.fork() == 0:
            server.close()
            _supervise(conn)
        conn.close()


if __name__ == "__main__":
    main(sys.argv[1])
