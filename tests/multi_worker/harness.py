"""Runs a worker script as N real processes on loopback, with TF_CONFIG.

Use it for every 2-workers-x-K-replicas test. A test gives a worker script
(a path, or Python source text); the harness picks free 127.0.0.1 ports,
starts `num_workers` `python` subprocesses, each with its own `TF_CONFIG` and
`KERAS_REPLICATOR_CPU_REPLICAS=replicas_per_worker` (so
`kr.MultiWorkerReplicator()` splits each worker's CPU into that many
replicas), waits at most `timeout` seconds, kills every worker on timeout or
(by default) as soon as one fails, and returns one `WorkerResult` each.

The worker writes its numbers with `write_result`, which puts JSON in the
file named by `KERAS_REPLICATOR_RESULT`. Importing this module does not
import TensorFlow, so worker scripts can use it cheaply.

Workers start from a zygote (`tests/multi_worker/zygote.py`): a server,
one per test process, that has imported TensorFlow, Keras and the package
once and forks each worker, so a worker skips the ~6 s of CPU those
imports cost. It is still a fresh process to TensorFlow. Its work still
costs seconds, so check several things in one run.

Example test (mark it `multi_worker`):

```python
from tests.multi_worker import harness

WORKER = '''
import keras_replicator as kr
from tests.multi_worker import harness

replicator = kr.MultiWorkerReplicator()
value = replicator.reduce("SUM", replicator.run(lambda: 1.0), axis=None)
harness.write_result({"sum": float(value)})
'''

@pytest.mark.multi_worker
def test_sum_counts_every_replica():
    results = harness.run_workers(WORKER, num_workers=2, replicas_per_worker=2)
    assert [r.result["sum"] for r in results] == [4.0, 4.0]
```

`run_workers` raises `WorkerError` (with every worker's output) when a
worker exits non-zero or times out, unless `check=False`.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULT_ENV = "KERAS_REPLICATOR_RESULT"
# Output that means another process grabbed a port between our pick and the
# worker's bind; the harness then retries with new ports.
_PORT_CLASH = (
    "Address already in use",
    "Failed to add port",
    "Could not start gRPC server",
)


@dataclasses.dataclass
class WorkerResult:
    """What one worker process did.

    Attributes:
        index: The worker's task index.
        returncode: Its exit code (negative: killed by that signal; None:
            still running when the harness gave up, then killed).
        output: Its stdout and stderr, interleaved.
        result: What it passed to `write_result`, or None.
        timed_out: Whether the harness killed it at the timeout.
    """

    index: int
    returncode: int | None
    output: str
    result: Any
    timed_out: bool = False


class WorkerError(AssertionError):
    """A worker failed or timed out; the message holds every output."""


def write_result(value: Any) -> None:
    """Called in a worker: saves a JSON-able `value` for the test to read.

    NumPy arrays and scalars are converted to lists and floats.

    Args:
        value: Any nest of dicts, lists, numbers, strings and NumPy values.
    """
    # "{index}" in the path: one file per worker when every worker shares
    # one environment, as under `keras-replicator launch`.
    path = os.environ[RESULT_ENV].format(index=task_index())
    with open(path, "w") as f:
        json.dump(value, f, default=_to_json)


def task_index() -> int:
    """Called in a worker: its index in TF_CONFIG, else its MPI rank, else 0.

    Under `mpiexec` (hydra sets PMI_RANK) the ranks have no TF_CONFIG.
    """
    config = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}")
    if "task" not in config and "PMI_RANK" in os.environ:
        return int(os.environ["PMI_RANK"])
    return int(config.get("task", {}).get("index", 0))


def _to_json(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"Not JSON-serialisable: {value!r}")


def free_ports(count: int) -> list[int]:
    """Returns `count` distinct free TCP ports on 127.0.0.1."""
    from keras_replicator._src.cluster import launch

    return launch.free_ports(count)


def worker_env(
    ports: Sequence[int],
    index: int,
    replicas_per_worker: int,
    result_path: str,
    env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of worker `index`: TF_CONFIG and device settings."""
    from keras_replicator._src.cluster import launch

    out = launch.worker_environ(
        ports, index, replicas_per_worker=replicas_per_worker
    )
    out.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    out["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), out.get("PYTHONPATH", "")) if p
    )
    out[RESULT_ENV] = result_path
    out.update(env or {})
    return out


# The transport of one-replica workers when a test names none.
TRANSPORT_ENV = "KERAS_REPLICATOR_TEST_TRANSPORT"


def run_workers(
    script: str | os.PathLike,
    num_workers: int = 2,
    replicas_per_worker: int = 2,
    timeout: float = 180,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    env_for: Callable[[int], Mapping[str, str]] | None = None,
    check: bool = True,
    kill_on_failure: bool = True,
    attempts: int = 2,
    transport: str | None = None,
) -> list[WorkerResult]:
    """Runs `script` as `num_workers` processes of one loopback cluster.

    Args:
        script: A path to a Python file, or Python source text.
        num_workers: Worker processes (TF_CONFIG job "worker", 0 is chief).
        replicas_per_worker: CPU replicas each worker's
            `MultiWorkerReplicator()` makes by default.
        timeout: Seconds until every worker still running is killed.
        args: Command-line arguments for the script.
        env: Extra environment variables for every worker.
        env_for: A function of the worker index giving extra environment
            variables for that worker only (e.g. its own `TMPDIR`).
        check: Raise `WorkerError` unless every worker exits with 0.
        kill_on_failure: Kill the others as soon as one exits non-zero.
            Fault tests set False to watch how the survivors end.
        attempts: Tries when a port was taken by someone else meanwhile.
        transport: `"grpc"`, or `"mpi"`: the same workers (same TF_CONFIG)
            started as the ranks of one `mpiexec`, so their collectives go
            over MPI (`KERAS_REPLICATOR_TRANSPORT=mpi`; one replica per
            worker). Every worker's return code is then mpiexec's.
            Defaults to `KERAS_REPLICATOR_TEST_TRANSPORT` where the workers
            hold one replica each (a whole run of the multi-worker tests
            over MPI, to see what differs), else `"grpc"`.

    Returns:
        One `WorkerResult` per worker, in task order.

    Raises:
        WorkerError: If `check` and a worker failed or timed out.
    """
    if transport is None:
        transport = "grpc"
        if replicas_per_worker == 1:
            transport = os.environ.get(TRANSPORT_ENV, "grpc")
    with tempfile.TemporaryDirectory(prefix="kr_workers_") as tmp:
        path = Path(script) if _is_path(script) else None
        if path is None:
            path = Path(tmp) / "worker.py"
            path.write_text(str(script))
        for attempt in range(attempts):
            run = _run_mpi if transport == "mpi" else _run_once
            results = run(
                path,
                num_workers,
                replicas_per_worker,
                timeout,
                args,
                env,
                env_for,
                kill_on_failure,
                Path(tmp),
            )
            clash = any(
                marker in r.output for r in results for marker in _PORT_CLASH
            )
            if not clash or attempt == attempts - 1:
                break
    if check and any(r.returncode != 0 for r in results):
        raise WorkerError(describe(results))
    return results


def _is_path(script) -> bool:
    if isinstance(script, os.PathLike):
        return True
    return "\n" not in script and script.endswith(".py")


def _run_once(
    path,
    num_workers,
    replicas,
    timeout,
    args,
    env,
    env_for,
    kill_on_failure,
    tmp,
):
    ports = free_ports(num_workers)
    outputs = [tmp / f"out_{i}.txt" for i in range(num_workers)]
    result_paths = [tmp / f"result_{i}.json" for i in range(num_workers)]
    for p in result_paths:
        p.unlink(missing_ok=True)
    procs = []
    try:
        for i in range(num_workers):
            own_env = worker_env(
                ports,
                i,
                replicas,
                str(result_paths[i]),
                {**(env or {}), **(env_for(i) if env_for else {})},
            )
            with open(outputs[i], "w") as out:
                procs.append(_start_worker([str(path), *args], own_env, out))
        timed_out = _wait(procs, timeout, kill_on_failure)
    finally:
        for proc in procs:
            _kill(proc)
    results = []
    for i, proc in enumerate(procs):
        result = None
        if result_paths[i].exists():
            result = json.loads(result_paths[i].read_text())
        results.append(
            WorkerResult(
                index=i,
                returncode=proc.returncode,
                output=outputs[i].read_text(errors="replace"),
                result=result,
                timed_out=timed_out[i],
            )
        )
    return results


def _start_worker(argv, env, out, err=None, cwd=REPO_ROOT):
    """`python argv` in its own session, from the zygote where it can.

    Its stdout goes to the file `out`, its stderr to `err` (default: `out`).
    """
    if _zygote_can_start(env):
        try:
            return _zygote().start(argv, env, out, err or out, cwd)
        except OSError:
            pass  # The zygote is gone: start this worker the usual way.
    return subprocess.Popen(
        [sys.executable, *argv],
        env=env,
        stdout=out,
        stderr=err or subprocess.STDOUT,
        cwd=str(cwd),
        # Own process group: kill the worker and anything it started.
        start_new_session=True,
    )


def run_python(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """`python *argv`, as `subprocess.run(..., capture_output=True, text=True)`.

    For a test that runs a script or `-c` code in a fresh process: started
    from the zygote where it can, like the workers. Its `sys.path` is what
    its own `PYTHONPATH` makes it (the zygote's does not leak into it).

    Args:
        argv: The arguments after `python`: a script and its arguments, or
            `-c`, the code and its arguments.
        env: Its whole environment. Defaults to this process's.
        cwd: Its working directory. Defaults to the repository.
        timeout: Seconds until it is killed (then `TimeoutExpired`).

    Returns:
        A `CompletedProcess` with its exit code, stdout and stderr.
    """
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="kr_python_") as tmp:
        paths = (Path(tmp) / "stdout.txt", Path(tmp) / "stderr.txt")
        with open(paths[0], "w") as out, open(paths[1], "w") as err:
            proc = _start_worker(argv, env, out, err, cwd or REPO_ROOT)
        try:
            proc.wait(timeout=timeout)
        finally:
            _kill(proc)
        stdout, stderr = (p.read_text(errors="replace") for p in paths)
    return subprocess.CompletedProcess(
        [sys.executable, *argv], proc.returncode, stdout, stderr
    )


# Off with KERAS_REPLICATOR_TEST_ZYGOTE=0: every worker a fresh `python`.
ZYGOTE_ENV = "KERAS_REPLICATOR_TEST_ZYGOTE"
# What Python, TensorFlow and Keras read while they are imported: a worker
# whose environment differs from the zygote's there starts the usual way.
_IMPORT_TIME = (
    "TF_CPP_MIN_LOG_LEVEL",
    "TF_CPP_MAX_VLOG_LEVEL",
    "TF_CPP_VMODULE",
    "TF_ENABLE_ONEDNN_OPTS",
    "OMP_NUM_THREADS",
    "KERAS_BACKEND",
    "KERAS_HOME",
    "CUDA_VISIBLE_DEVICES",
)
_ZYGOTE_SERVER = None


def _zygote_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
    )
    env.pop(RESULT_ENV, None)
    env.pop("TF_CONFIG", None)
    return env


def _zygote_can_start(env: Mapping[str, str]) -> bool:
    if os.environ.get(ZYGOTE_ENV, "1") == "0":
        return False
    base = _zygote_env()
    # PYTHONPATH may differ: the worker sets its own `sys.path`.
    keys = [k for k in {*env, *base} if k.startswith("PYTHON")]
    keys += _IMPORT_TIME
    return all(
        env.get(k) == base.get(k)
        for k in keys
        if k not in ("PYTHONUNBUFFERED", "PYTHONPATH")
    )


def _zygote():
    global _ZYGOTE_SERVER
    if _ZYGOTE_SERVER is None or _ZYGOTE_SERVER.proc.poll() is not None:
        _ZYGOTE_SERVER = _Zygote()
    return _ZYGOTE_SERVER


class _Zygote:
    """The server of `tests/multi_worker/zygote.py`, one per test process."""

    def __init__(self, timeout: float = 180):
        self.folder = tempfile.mkdtemp(prefix="kr_zygote_")
        self.path = os.path.join(self.folder, "socket")
        self.log = open(os.path.join(self.folder, "log.txt"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.multi_worker.zygote", self.path],
            env=_zygote_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=str(REPO_ROOT),
        )
        atexit.register(self.close)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready or self.proc.stdout.readline().strip() != b"ready":
            self.close()
            raise OSError("the test zygote did not start")

    def start(self, argv, env, out, err, cwd) -> _ZygoteWorker:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd)}
        with open(os.devnull) as null:
            socket.send_fds(
                conn,
                [json.dumps(request).encode() + b"\n"],
                [null.fileno(), out.fileno(), err.fileno()],
            )
        return _ZygoteWorker(conn)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc.stdout.close()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class _ZygoteWorker:
    """A zygote's worker, as much of `subprocess.Popen` as the harness uses."""

    def __init__(self, conn: socket.socket):
        self._conn = conn
        self._lines = conn.makefile("r")
        self.returncode = None
        message = self._read(timeout=60)
        if not message or "pid" not in message:
            conn.close()
            raise OSError(f"the test zygote started no worker: {message}")
        self.pid = message["pid"]

    def _read(self, timeout):
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return None
        line = self._lines.readline()
        # No line: the supervisor died with the zygote; its worker is
        # killed with it (`_kill`), so report it as killed.
        return json.loads(line) if line else {"status": -signal.SIGKILL}

    def poll(self):
        if self.returncode is None:
            message = self._read(timeout=0)
            if message is not None:
                self.returncode = message["status"]
                self._conn.close()
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("zygote worker", timeout)
            select.select([self._conn], [], [], left)
        return self.returncode


def _run_mpi(
    path,
    num_workers,
    replicas,
    timeout,
    args,
    env,
    env_for,
    kill_on_failure,
    tmp,
):
    """`_run_once` with the workers as the ranks of one `mpiexec` (MPMD)."""
    del kill_on_failure  # mpiexec ends every rank when one fails.
    if replicas != 1:
        raise ValueError(
            f"MPI carries one replica per worker. Received: replicas={replicas}"
        )
    ports = free_ports(num_workers)
    result_paths = [tmp / f"result_{i}.json" for i in range(num_workers)]
    common = mpiexec_env({**(env or {}), "KERAS_REPLICATOR_TRANSPORT": "mpi"})
    common["KERAS_REPLICATOR_CPU_REPLICAS"] = "1"
    mpiexec_path, _, _, python = mpiexec_command(1)
    argv = [
        mpiexec_path,
        "-outfile-pattern",
        str(tmp / "out_%r.txt"),
        "-errfile-pattern",
        str(tmp / "err_%r.txt"),
    ]
    for i in range(num_workers):
        result_paths[i].unlink(missing_ok=True)
        own = worker_env(ports, i, replicas, str(result_paths[i]), {})
        per_rank = {
            "TF_CONFIG": own["TF_CONFIG"],
            RESULT_ENV: own[RESULT_ENV],
            **(env_for(i) if env_for else {}),
        }
        if i:
            argv.append(":")
        argv += ["-n", "1"]
        for key, value in per_rank.items():
            argv += ["-env", key, value]
        argv += [python, str(path), *args]
    proc = subprocess.Popen(
        argv, env=common, cwd=str(REPO_ROOT), start_new_session=True
    )
    try:
        (timed_out,) = _wait([proc], timeout, True)
    finally:
        _kill(proc)
    results = []
    for i in range(num_workers):
        result = None
        if result_paths[i].exists():
            result = json.loads(result_paths[i].read_text())
        output = "".join(
            f.read_text(errors="replace") if f.exists() else ""
            for f in (tmp / f"out_{i}.txt", tmp / f"err_{i}.txt")
        )
        results.append(
            WorkerResult(
                index=i,
                returncode=proc.returncode,
                output=output,
                result=result,
                timed_out=timed_out,
            )
        )
    return results


def _wait(procs, timeout, kill_on_failure) -> list[bool]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [False] * len(procs)
        if kill_on_failure and any(c not in (None, 0) for c in codes):
            return [False] * len(procs)
        time.sleep(0.1)
    return [p.poll() is None for p in procs]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def command_line() -> list[str]:
    """The `keras-replicator` command as an argv: the installed script.

    The console script next to this Python, as a user runs it; without one
    (the package not installed), `python -m` on the module it runs.
    """
    script_path = Path(sys.executable).parent / "keras-replicator"
    if script_path.exists():
        return [str(script_path)]
    return [sys.executable, "-m", "keras_replicator._src.cli.main"]


def launch_command(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    num_workers: int = 2,
    replicas_per_worker: int = 2,
    max_restarts: int = 0,
    transport: str | None = None,
) -> list[str]:
    """`keras-replicator launch ... -- python script args`, as an argv."""
    chosen = [] if transport is None else ["--transport", transport]
    return [
        *command_line(),
        "launch",
        "--workers",
        str(num_workers),
        "--replicas-per-worker",
        str(replicas_per_worker),
        "--max-restarts",
        str(max_restarts),
        *chosen,
        "--",
        sys.executable,
        str(script),
        *args,
    ]


def run_launcher(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    num_workers: int = 2,
    replicas_per_worker: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 240,
    max_restarts: int = 0,
    transport: str | None = None,
) -> tuple[subprocess.CompletedProcess, list[Any]]:
    """Runs `keras-replicator launch --workers N -- python script args`.

    Args:
        script: A path to the worker script.
        args: Command-line arguments for the script.
        num_workers: `--workers`.
        replicas_per_worker: `--replicas-per-worker`.
        env: Extra environment variables for the launcher (and so for every
            worker).
        timeout: Seconds until the launcher is killed (then
            `subprocess.TimeoutExpired` is raised; its workers die with it).
        max_restarts: `--max-restarts`.
        transport: `--transport` (`"grpc"` or `"mpi"`), or None for
            the launcher's default.

    Returns:
        The launcher's `CompletedProcess` (text stdout with both workers'
        prefixed lines) and each worker's `write_result` value (or None).
    """
    command = launch_command(
        script, args, num_workers, replicas_per_worker, max_restarts, transport
    )
    with tempfile.TemporaryDirectory(prefix="kr_launch_") as tmp:
        full_env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
            "PYTHONPATH": str(REPO_ROOT),
            RESULT_ENV: os.path.join(tmp, "result_{index}.json"),
            **(env or {}),
        }
        proc = subprocess.run(
            command,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO_ROOT,
        )
        results = []
        for i in range(num_workers):
            path = Path(tmp) / f"result_{i}.json"
            results.append(
                json.loads(path.read_text()) if path.exists() else None
            )
    return proc, results


class Background:
    """A command started in its own session; its output goes to a file.

    For tests that signal or kill a run while it goes on. Each worker's
    `write_result` lands in `<folder>/<name>_<index>.json`.

    Args:
        command: The argv.
        folder: Where the log and the results go.
        name: Names the log (`<name>.log`) and the results.
        env: The full environment of the command.
    """

    def __init__(
        self,
        command: Sequence[str],
        folder: Path,
        name: str,
        env: Mapping[str, str],
    ):
        self.folder, self.name = Path(folder), name
        self.log = self.folder / f"{name}.log"
        full_env = {
            **env,
            RESULT_ENV: str(self.folder / f"{name}_{{index}}.json"),
        }
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                list(command),
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                start_new_session=True,
            )

    def wait(self, timeout: float) -> int:
        """Its exit code; kills its group (then raises) at the timeout."""
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """Kills its process group, if it still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def output(self) -> str:
        """Everything it printed so far."""
        return self.log.read_text(errors="replace")

    def result(self, index: int = 0) -> Any:
        """Worker `index`'s `write_result` value, or None."""
        path = self.folder / f"{self.name}_{index}.json"
        return json.loads(path.read_text()) if path.exists() else None


def wait_for_pid_file(path: Path, run: Background, timeout: float = 180) -> int:
    """Waits until a worker wrote its pid to `path`; returns the pid.

    Raises:
        AssertionError: With the run's output, if it ended or `timeout`
            passed first.
    """
    deadline = time.monotonic() + timeout
    while True:
        # The file may exist before its pid is written: read until it
        # parses.
        text = path.read_text().strip() if path.exists() else ""
        if text.isdigit():
            return int(text)
        assert run.proc.poll() is None, run.output()[-4000:]
        assert time.monotonic() < deadline, run.output()[-4000:]
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, already ended, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the parenthesised command name.
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until_gone(pids: Sequence[int], timeout: float = 30) -> list[int]:
    """Waits up to `timeout` s for `pids` to end; returns those alive."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@contextmanager
def jupyter_kernel(cwd, unset: Sequence[str] = ("TF_CONFIG",)) -> Iterator:
    """A real Jupyter kernel in `cwd` that imports this repository.

    Args:
        cwd: The kernel's working directory.
        unset: Environment variables the kernel must not inherit.

    Yields:
        `(manager, client)`: the `KernelManager` (to interrupt the kernel)
        and a ready client with its channels started.
    """
    from jupyter_client.manager import KernelManager

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO_ROOT))
    for name in unset:
        env.pop(name, None)
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env=env, cwd=str(cwd))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def execute_cell(client, code: str, timeout: float) -> tuple[dict, str]:
    """Runs `code` in a Jupyter kernel; its reply and everything it showed.

    Args:
        client: A started `jupyter_client` kernel client.
        code: The cell's source.
        timeout: Seconds to wait for the reply.

    Returns:
        The reply's content (`status`, and `ename`/`evalue` on error) and
        the cell's streams and error tracebacks, joined.
    """
    outputs = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            outputs.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            outputs.append("\n".join(msg["content"]["traceback"]))

    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    return reply["content"], "".join(outputs)


def describe(results: Sequence[WorkerResult], tail: int = 4000) -> str:
    """Every worker's exit code and the end of its output, for errors."""
    parts = []
    for r in results:
        state = "timed out" if r.timed_out else f"exit code {r.returncode}"
        parts.append(f"--- worker {r.index}: {state} ---\n{r.output[-tail:]}")
    return "\n".join(parts)


def mpiexec_command(n: int = 2) -> list[str]:
    """`mpiexec -n <n> <this python>`: PyPI's mpich, beside this Python."""
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    assert found, "mpiexec not found: install the dev extra (PyPI mpich)"
    return [found, "-n", str(n), sys.executable]


def mpiexec_env(env: dict | None = None) -> dict:
    """This environment without a cluster, plus `env`."""
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", RESULT_ENV, "KERAS_REPLICATOR_TRANSPORT")
        and not k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_"))
    }
    full_env.update(
        PYTHONPATH=str(REPO_ROOT), TF_CPP_MIN_LOG_LEVEL="3", **(env or {})
    )
    return full_env


def mpiexec(*args, timeout: float, env: dict | None = None, n: int = 2):
    """Runs `mpiexec -n <n> python <args>`; returns the CompletedProcess."""
    return subprocess.run(
        [*mpiexec_command(n), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=mpiexec_env(env),
    )
