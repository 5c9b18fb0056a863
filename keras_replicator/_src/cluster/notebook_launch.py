"""`kr.launch(fn, ...)`: run a function on local worker processes.

The notebook counterpart of `keras-replicator launch` (as Hugging Face
Accelerate's `notebook_launcher`). TensorFlow fixes its devices and cluster
when its runtime starts, so workers cannot be threads of a kernel that ran
TensorFlow: every call starts fresh processes (calling again in the same
kernel works).
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import cloudpickle

from keras_replicator._src.cluster import launch as launch_lib
from keras_replicator._src.cluster import reaper as reaper_lib
from keras_replicator._src.core import env
from keras_replicator._src.core import validation
from keras_replicator._src.training import hang_watchdog

WORKER_COMMAND = (
    sys.executable,
    "-u",
    "-m",
    "keras_replicator._src.cluster.launch_worker",
)
# Seconds the workers get to exit after all returned (TensorFlow's
# coordination service shuts down with a barrier), before they are killed.
_EXIT_GRACE_SECONDS = 30.0
# Seconds between checks of the workers; output is shown as it comes.
_POLL_SECONDS = 0.1


class RemoteTraceback(Exception):
    """A worker's traceback, as text; the cause of the error `launch` raises."""

    def __str__(self) -> str:
        return self.args[0]


def launch(
    fn: Callable[..., Any],
    *args: Any,
    workers: int = 2,
    replicas_per_worker: int | None = None,
    ps: int = 0,
    **kwargs: Any,
) -> list:
    """Runs `fn(*args, **kwargs)` on local worker processes; returns results.

    Starts `workers` fresh processes, each with a `TF_CONFIG` naming every
    worker at `127.0.0.1:<free port>`, so `kr.auto()` (or
    `kr.MultiWorkerReplicator()`) in `fn` makes one synchronous cluster.
    Create the replicator first in `fn`, before other TensorFlow code (see
    `MultiWorkerReplicator`). `fn`, `args`, `kwargs` and the return values
    must be picklable by cloudpickle, which sends a function defined in a
    notebook cell by value.

    Worker output streams into the caller line by line, prefixed `[worker i]`
    (`[chief]`, `[ps i]` with parameter servers); `verbose=2` in `fit` prints
    one line per epoch. When a worker raises, the others are ended and its
    exception is raised here, its traceback as the cause. Interrupting the
    caller (Ctrl-C, the notebook's interrupt button) ends every worker; so
    does the caller's death, SIGKILL included (a watcher process kills the
    workers' process groups). A worker stuck for the hang watchdog's timeout
    prints its stacks and exits with code 76, and a `RuntimeError` says so.

    With `ps > 0` the cluster is asynchronous (`kr.AsyncReplicator`): `fn`
    runs once, on the "chief" (the coordinator), the worker and ps tasks run
    TensorFlow servers, and the result is `[fn's return value on the chief]`;
    the servers are ended then.

    Bounds: a worker whose peers never come up ends after the replicator's
    `timeout_seconds` (default 60 s); a lost worker is reported within about
    10 s; after every worker returned, the processes get 30 s to exit before
    they are killed; ended workers get 5 s before SIGKILL. The run itself has
    no time limit.

    Example (in a notebook cell):
    ```python
    def train(epochs):
        import keras_replicator as kr
        replicator = kr.auto()  # a MultiWorkerReplicator here
        ...
        return model.get_weights()

    weights = kr.launch(train, 3, workers=2)  # [worker 0's, worker 1's]
    ```

    Args:
        fn: The function each worker (or, with `ps`, the chief) calls.
        *args: Positional arguments for `fn`.
        workers: Worker processes, at least 1. Defaults to 2.
        replicas_per_worker: CPU replicas per worker (sets
            `KERAS_REPLICATOR_CPU_REPLICAS`). Defaults to None: the caller's
            `KERAS_REPLICATOR_CPU_REPLICAS` if set, else 1 CPU replica per
            worker (or its GPUs; each worker sees all the host's GPUs,
            untested here).
        ps: Parameter servers. Defaults to 0 (synchronous workers).
        **kwargs: Keyword arguments for `fn`.

    Returns:
        The return values of `fn`, in worker order (`[chief's]` with `ps`).

    Raises:
        TypeError: If `fn` is not callable or cannot be pickled.
        ValueError: If `workers`, `replicas_per_worker` or `ps` is out of
            range.
        RuntimeError: If a worker ended without returning (killed, or
            exited), naming it and its exit code.
        KeyboardInterrupt: If interrupted, after ending every worker.
        Exception: The exception a worker's `fn` raised (its traceback is
            the `__cause__`).
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable. Received: fn={fn!r}")
    validation.check_positive_int("workers", workers)
    validation.check_positive_int(
        "replicas_per_worker", replicas_per_worker, allow_none=True
    )
    validation.check_non_negative_int("ps", ps)
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as error:  # noqa: BLE001 - many pickling errors exist
        raise TypeError(
            "`kr.launch` sends `fn` and its arguments to the workers with "
            f"cloudpickle, which failed: {error}. Received: fn={fn!r}"
        ) from error
    with (
        tempfile.TemporaryDirectory(prefix="kr_launch_") as tmp,
        reaper_lib.Reaper() as reaper,
    ):
        payload_path = os.path.join(tmp, "payload.pkl")
        with open(payload_path, "wb") as f:
            f.write(payload)
        for attempt in range(1, launch_lib._PORT_ATTEMPTS + 1):  # noqa: SLF001
            run = _Run(
                tmp, payload_path, workers, replicas_per_worker, ps, reaper
            )
            try:
                return run.wait()
            except _PortClash:
                if attempt == launch_lib._PORT_ATTEMPTS:  # noqa: SLF001
                    raise run.failure() from None
                _print(
                    "[launch] another process took a worker's port before "
                    "it bound it; starting all workers again on new ports "
                    f"({attempt + 1} of {launch_lib._PORT_ATTEMPTS})"  # noqa: SLF001
                )
            finally:
                run.end()
    raise AssertionError("unreachable")


class _PortClash(Exception):
    """A worker failed after reporting that its port was taken."""


class _Run:
    """One start of every process, and the watch over them."""

    def __init__(
        self, tmp, payload_path, workers, replicas_per_worker, ps, reaper
    ):
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reaper = reaper
        self._clash = threading.Event()
        self.procs: list[subprocess.Popen] = []
        self._pumps: list[threading.Thread] = []
        self._failed: tuple[str, Any] | None = None
        tasks = _tasks(workers, replicas_per_worker, ps)
        # The tasks that run `fn`: every worker, or the chief alone.
        self.callers = [i for i, t in enumerate(tasks) if t[1] is None]
        self.names = [t[0] for t in tasks]
        self.results = {
            i: os.path.join(tmp, f"result_{i}_{time.monotonic_ns()}.pkl")
            for i in self.callers
        }
        extra_path = os.pathsep.join(
            p for p in sys.path if p and os.path.isdir(p)
        )
        try:
            for i, (name, argv, task_env) in enumerate(tasks):
                task_env = dict(task_env)
                task_env[env.LAUNCH_PAYLOAD] = payload_path
                task_env[env.LAUNCH_RESULT] = self.results.get(i, "")
                task_env["PYTHONUNBUFFERED"] = "1"
                # The caller's imports (a notebook's sys.path edits too).
                task_env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (extra_path, task_env.get("PYTHONPATH")) if p
                )
                proc = subprocess.Popen(
                    list(argv or WORKER_COMMAND),
                    env=task_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    # Kept open, never written: EOF tells the worker that
                    # the caller died (launch_worker.py).
                    stdin=subprocess.PIPE,
                    # Own process group: a kernel interrupt reaches the
                    # caller only, which then ends every group.
                    start_new_session=True,
                )
                self.procs.append(proc)
                reaper.watch(proc.pid)
                pump = threading.Thread(
                    target=self._pump,
                    args=(proc.stdout, f"[{name}] "),
                    daemon=True,
                )
                pump.start()
                self._pumps.append(pump)
        except BaseException:
            self.end()
            raise

    def _pump(self, stream, prefix: str) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            if any(marker in line for marker in launch_lib.PORT_CLASH):
                self._clash.set()
            self._lines.put(prefix + line)
        stream.close()

    def _drain(self, timeout: float) -> None:
        # Printed from the caller's thread: a notebook shows what the main
        # thread prints in the running cell.
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            return
        _print(line)
        while True:
            try:
                _print(self._lines.get_nowait())
            except queue.Empty:
                return

    def _record(self, index: int):
        path = self.results[index]
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            return pickle.load(f)

    def wait(self) -> list:
        """Waits for every caller task; returns their values in order."""
        done: dict[int, Any] = {}
        while len(done) < len(self.callers):
            self._drain(_POLL_SECONDS)
            for i in self.callers:
                if i in done:
                    continue
                record = self._record(i)
                if record is not None and record[0] == "error":
                    self._failed = (self.names[i], record)
                    if any(m in record[2] for m in launch_lib.PORT_CLASH):
                        raise _PortClash
                    raise self.failure()
                if record is not None:
                    done[i] = record
                    continue
                code = self.procs[i].poll()
                if code is not None and self._record(i) is None:
                    self._failed = (self.names[i], code)
                    self._finish_output()
                    if self._clash.is_set():
                        raise _PortClash
                    raise self.failure()
        self._wait_exit()
        return [cloudpickle.loads(done[i][1]) for i in self.callers]

    def failure(self) -> BaseException:
        """The exception that reports the failed task."""
        name, record = self._failed
        if not isinstance(record, tuple):
            code = launch_lib._exit_code(record)  # noqa: SLF001
            why = ""
            if code == hang_watchdog.EXIT_CODE:
                why = (
                    " The hang watchdog ended it: no step finished for its "
                    "timeout (KERAS_REPLICATOR_HANG_SECONDS); its stacks "
                    "are above."
                )
            return RuntimeError(
                f"`kr.launch`: {name} ended without returning a result "
                f"(exit code {code}; its output is above); the other "
                f"workers were ended.{why} Received: exit_code={code}"
            )
        _, blob, text = record
        cause = RemoteTraceback(f'\n{name} raised:\n"""\n{text}"""')
        error = None
        if blob is not None:
            try:
                error = pickle.loads(blob)
            except Exception:  # noqa: BLE001 - fall back to the text
                error = None
        if not isinstance(error, BaseException):
            error = RuntimeError(
                f"`kr.launch`: {name} raised (its traceback is the cause "
                "above); the other workers were ended."
            )
        error.__cause__ = cause
        return error

    def _wait_exit(self) -> None:
        deadline = time.monotonic() + _EXIT_GRACE_SECONDS
        callers = [self.procs[i] for i in self.callers]
        while time.monotonic() < deadline and any(
            p.poll() is None for p in callers
        ):
            self._drain(_POLL_SECONDS)
        self._finish_output()

    def _finish_output(self) -> None:
        for pump in self._pumps:
            pump.join(timeout=1.0)
        self._drain(0)

    def end(self) -> None:
        """Ends every process (SIGTERM, then SIGKILL after 5 s)."""
        try:
            launch_lib._end_all(self.procs)  # noqa: SLF001
        except KeyboardInterrupt:
            # Interrupted again while waiting for them: kill at once.
            for proc in self.procs:
                launch_lib._signal_group(proc, signal.SIGKILL)  # noqa: SLF001
                proc.wait()
            raise
        for proc in self.procs:
            self._reaper.forget(proc.pid)
            if proc.stdin:
                proc.stdin.close()
        for pump in self._pumps:
            pump.join(timeout=launch_lib._GRACE_SECONDS)  # noqa: SLF001
        self._drain(0)


def _tasks(workers, replicas_per_worker, ps):
    """(name, argv or None for `fn`'s runner, env) of every process."""
    if ps:
        return [
            (name, None if name == "chief" else argv, task_env)
            for name, argv, task_env in launch_lib._ps_tasks(  # noqa: SLF001
                WORKER_COMMAND, workers, ps, replicas_per_worker
            )
        ]
    ports = launch_lib.free_ports(workers)
    return [
        (
            f"worker {i}",
            None,
            launch_lib.worker_environ(ports, i, replicas_per_worker),
        )
        for i in range(workers)
    ]


def _print(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
