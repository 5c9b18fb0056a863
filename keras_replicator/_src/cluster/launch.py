"""`keras-replicator launch`: N local worker processes with TF_CONFIG.

Each worker gets a TF_CONFIG naming every worker at `127.0.0.1:<free port>`
(local launches never listen beyond loopback) and its task index; its output
lines are prefixed with its name. When one worker fails, the others are ended
and the launcher exits with its code or, with `max_restarts`, starts the
group again on new ports. Ctrl-C ends all. A preemption signal (those in
`KERAS_REPLICATOR_PREEMPTION_SIGNALS`, default `SIGTERM,SIGUSR1`) is
forwarded to every worker; they save at the same step and exit with
`preemption.EXIT_CODE`, and so does the launcher. A worker ended by the hang
watchdog (`hang_watchdog.EXIT_CODE`, 76, also its backstop's exit for a
process stuck holding the GIL) fails the group like any failure, once the
others had a few seconds to print their stacks. A port taken between our pick
and a worker's bind relaunches every worker on new ports. Workers die with
the launcher, however it dies (`reaper.py`).

A command starting with `python` (`python3`, `python3.11`) runs on
`sys.executable` when `python` on `PATH` is another interpreter, e.g. the
system's, without Keras, in a shell where the venv is not active
(`prepare_command`). Its script must exist before any worker starts.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TextIO

from keras_replicator._src.cluster import config as cluster_lib
from keras_replicator._src.cluster import reaper as reaper_lib
from keras_replicator._src.cluster import tf_logs
from keras_replicator._src.cluster import transport as transport_lib
from keras_replicator._src.core import env
from keras_replicator._src.core import validation
from keras_replicator._src.training import hang_watchdog
from keras_replicator._src.training import preemption

# Workers and ps tasks of a parameter-server cluster run a bare TF server
# (`async_ps.serve`), started by name: the launcher imports no replicator.
SERVE_COMMAND = (
    sys.executable,
    "-c",
    "from keras_replicator._src.replicators import async_ps; async_ps.serve()",
)
LOOPBACK = "127.0.0.1"
CPU_REPLICAS_ENV = env.CPU_REPLICAS
LAUNCHED_ENV = env.LAUNCHED
# Seconds between SIGTERM and SIGKILL when ending workers.
_GRACE_SECONDS = 5.0
# A worker's output that means another process took its port between our
# pick (`free_ports`) and its bind. TensorFlow's gRPC server logs the first
# two, and raises with the third (all that shows with TF_CPP_MIN_LOG_LEVEL=3).
PORT_CLASH = (
    "Address already in use",
    "Failed to add port",
    "Could not start gRPC server",
)
# Launches in all when a port was taken; the clash comes as the cluster
# starts, before any training step, so a relaunch loses nothing.
_PORT_ATTEMPTS = 3
# Seconds preempted workers get to reach a step, save and exit, before SIGKILL.
PREEMPT_GRACE_SECONDS = 30.0
# Seconds the others get, after the hang watchdog ended one, to print their
# own stacks before they are ended.
HANG_GRACE_SECONDS = 10.0
# Program names that mean "a Python interpreter": python, python3, python3.11.
_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?t?)?(\.exe)?")
# Python options taking a value (the next argument or the rest of this one),
# and those after which no script follows (`-c code`, `-m module`).
_PYTHON_VALUE_OPTIONS = "WX"
_PYTHON_NO_SCRIPT_OPTIONS = "cm"
_PYTHON_LONG_VALUE_OPTIONS = ("--check-hash-based-pycs",)
_EMPTY_COMMAND = (
    "`launch` needs a command to run, e.g. `keras-replicator launch "
    "--workers 2 -- python train.py`. Received: command=[]"
)


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 now (held open together).

    Another process may take one before the worker binds it; callers retry.
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(
                socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            )
            sock.bind((LOOPBACK, 0))
            ports.append(sock.getsockname()[1])
        return ports


def worker_environ(
    ports: Sequence[int],
    index: int,
    replicas_per_worker: int | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A copy of `base` (default `os.environ`) with worker `index`'s TF_CONFIG.

    `ports` has one port per worker, in task order. `replicas_per_worker`, if
    given, sets `KERAS_REPLICATOR_CPU_REPLICAS`: the CPU replicas of each
    worker's `MultiWorkerReplicator()`.
    """
    env = dict(os.environ if base is None else base)
    hosts = [f"{LOOPBACK}:{port}" for port in ports]
    env["TF_CONFIG"] = cluster_lib.make_tf_config(hosts, index).to_json()
    if replicas_per_worker is not None:
        env[CPU_REPLICAS_ENV] = str(replicas_per_worker)
    return env


def _is_python(program: str) -> bool:
    return _PYTHON_NAME.fullmatch(os.path.basename(program)) is not None


def _same_interpreter(path: str, executable: str) -> bool:
    """Whether `path` starts the same Python, in the same environment."""
    try:
        same_file = os.path.samefile(path, executable)
    except OSError:
        return False
    # A venv's `python` links to the base interpreter: the same file, but only
    # the link in the venv's folder runs with the venv's packages.
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    own = os.path.realpath(os.path.dirname(os.path.abspath(executable)))
    return same_file and folder == own


def python_script(command: Sequence[str]) -> str | None:
    """The script a `python ...` command runs, or None.

    None for programs that are not a Python interpreter (`python`,
    `python3.11`, a path to one) and for `python -m`, `-c` and `-`.
    """
    if not command or not _is_python(command[0]):
        return None
    args = list(command[1:])
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-" or not arg.startswith("-"):
            return None if arg == "-" else arg
        if arg.startswith("--"):
            takes_next = arg in _PYTHON_LONG_VALUE_OPTIONS  # not `--x=v`
            i += 2 if takes_next else 1
            continue
        # Short options combine (`-uc code`): the first that takes a value
        # ends this argument, and takes the next one if nothing follows it.
        for j, letter in enumerate(arg[1:], start=1):
            if letter in _PYTHON_NO_SCRIPT_OPTIONS:
                return None
            if letter in _PYTHON_VALUE_OPTIONS:
                i += 1 if j + 1 < len(arg) else 2
                break
        else:
            i += 1
    return None


def prepare_command(
    command: Sequence[str], swap_python: bool = True
) -> tuple[list[str], str | None]:
    """Checks a worker command, before any starts; may swap its `python`.

    Args:
        command: The program and its arguments, e.g. `["python", "train.py"]`.
        swap_python: Whether a program named `python`, `python3` or
            `pythonX.Y` (a name, not a path) that does not start
            `sys.executable` in its environment is replaced by it (the module
            docstring says why). Defaults to True.

    Returns:
        The command to run, and a `[launch]` line saying that `python` was
        replaced (None if it was not).

    Raises:
        ValueError: If `command` is empty, or the script a `python ...`
            command names does not exist.
    """
    if not command:
        raise ValueError(_EMPTY_COMMAND)
    command = list(command)
    note = None
    program = command[0]
    if swap_python and _is_python(program) and os.sep not in program:
        found = shutil.which(program)
        if found is None or not _same_interpreter(found, sys.executable):
            where = f"is {found}" if found else "is not on PATH"
            note = (
                f"[launch] `{program}` {where}, not the Python running "
                f"keras-replicator: the workers run {sys.executable} "
                "(--no-python-swap keeps the command as given)"
            )
            command[0] = sys.executable
    script = python_script(command)
    if script is not None and not os.path.exists(script):
        raise ValueError(
            f"`launch` runs the script {script!r}, but "
            f"{os.path.abspath(script)} does not exist; no worker was "
            "started. Give the script's path, absolute or relative to the "
            f"current folder. Received: script={script!r}"
        )
    return command, note


def launch(
    command: Sequence[str],
    workers: int,
    replicas_per_worker: int | None = None,
    ps: int = 0,
    out: TextIO | None = None,
    max_restarts: int = 0,
    swap_python: bool = True,
    quiet: bool = False,
    transport: str = transport_lib.GRPC,
) -> int:
    """Runs `command` as `workers` local processes of one cluster.

    Args:
        command: The program and its arguments, e.g. `["python", "train.py"]`.
        workers: The number of worker processes, at least 1.
        replicas_per_worker: CPU replicas per worker (see `worker_environ`).
            Defaults to None (not set).
        ps: Parameter-server tasks. With `ps > 0`, `command` runs on a
            "chief" task only (the `AsyncReplicator` coordinator), the worker
            and ps tasks run TensorFlow servers, and the run ends when the
            chief exits. Defaults to 0.
        out: Where prefixed output goes. Defaults to `sys.stdout`.
        max_restarts: How often to restart every worker, on new ports, after
            one exited non-zero or was killed, the hang watchdog's exit (76)
            included; a `[launch]` line says so. Scripts resume from their
            `BackupAndRestore` backup. A preempted group is not restarted.
            Defaults to 0.
        swap_python: See `prepare_command`; a line on stderr says when
            `python` was swapped. Defaults to True.
        quiet: Whether TensorFlow's C++ start-up logs are hidden: each task
            gets `TF_CPP_MIN_LOG_LEVEL=3` unless set, and the lines written
            before it applies are dropped (`tf_logs`). Defaults to False.
        transport: `"grpc"` (TF_CONFIG for every worker) or `"mpi"`: one
            `mpiexec -n workers command` (`find_mpiexec`), one rank and one
            replica per worker, collectives over mpi4py. Its process group
            gets a worker's signals, so preemption, restarts and the reaper
            work the same. Defaults to `"grpc"`.

    Preempted workers get `PREEMPT_GRACE_SECONDS` (30) to save and exit.
    A port clash ("Address already in use") relaunches everything on new
    ports, up to `_PORT_ATTEMPTS` (3) launches in all.

    Returns:
        0 if every worker (with `ps`: the chief) succeeded; 75
        (`preemption.EXIT_CODE`) if the workers were preempted and saved (a
        signal to the launcher or to a worker); else the first failed
        worker's exit code (128 + N if ended by signal N) once no restart is
        left; 130 after Ctrl-C.

    Raises:
        ValueError: If `command` is empty or names a script that does not
            exist, or `workers`, `ps` or `max_restarts` is out of range, or
            `KERAS_REPLICATOR_PREEMPTION_SIGNALS` names no signal, or
            `transport="mpi"` with `ps` or more than one replica per
            worker, or no mpiexec is found.
    """
    if not command:
        raise ValueError(_EMPTY_COMMAND)
    validation.check_positive_int("workers", workers)
    validation.check_non_negative_int("ps", ps)
    validation.check_non_negative_int("max_restarts", max_restarts)
    mpiexec = None
    if transport == transport_lib.MPI:
        mpiexec = _check_mpi(replicas_per_worker, ps)
    elif transport != transport_lib.GRPC:
        raise ValueError(
            f"`transport` must be one of {transport_lib.TRANSPORTS}. "
            f"Received: transport={transport!r}"
        )
    command, note = prepare_command(command, swap_python)
    if note:
        print(note, file=sys.stderr, flush=True)
    say = functools.partial(_print, out or sys.stdout, threading.Lock())
    received: list[int] = []
    with (
        reaper_lib.Reaper() as reaper,
        _forwarding(preemption.signals_from_env(), received),
    ):
        clashes = restarts = 0
        while True:
            code, clash, preempted = _launch_once(
                command,
                workers,
                replicas_per_worker,
                ps,
                say,
                received,
                reaper,
                quiet,
                mpiexec,
            )
            if code in (0, 130) or preempted or received:
                return code
            if clash.is_set() and clashes + 1 < _PORT_ATTEMPTS:
                clashes += 1
                say(
                    "[launch] another process took a worker's port before "
                    "it bound it; starting all workers again on new ports "
                    f"({clashes + 1} of {_PORT_ATTEMPTS})",
                )
                continue
            if restarts < max_restarts:
                restarts += 1
                say(
                    f"[launch] a worker exited with code {code}; starting "
                    "all workers again on new ports (restart "
                    f"{restarts} of {max_restarts})",
                )
                continue
            return code


@contextlib.contextmanager
def _forwarding(signals, received: list[int]):
    """Records preemption signals in `received` (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def record(signum, frame):
        del frame
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in signals}
    if signal.SIGTERM not in previous:
        # Not a preemption signal: SIGTERM ends every worker now, like Ctrl-C.
        previous[signal.SIGTERM] = signal.signal(
            signal.SIGTERM, _raise_interrupt
        )
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def find_mpiexec() -> str | None:
    """The mpiexec beside `sys.executable`, else on `PATH`, or None."""
    beside = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    return beside or shutil.which("mpiexec")


def _check_mpi(replicas_per_worker, ps) -> str:
    """Refuses what MPI cannot carry; returns the mpiexec to run."""
    if replicas_per_worker not in (None, 1):
        raise ValueError(
            "`--transport mpi` carries one replica per process (one rank "
            "per worker); use --workers for more replicas, or --transport "
            "grpc. Received: replicas_per_worker="
            f"{replicas_per_worker}"
        )
    if ps:
        raise ValueError(
            "`--transport mpi` runs synchronous workers only; parameter "
            f"servers need --transport grpc. Received: ps={ps}"
        )
    found = find_mpiexec()
    if found is None:
        raise ValueError(
            "`--transport mpi` starts the workers with mpiexec, but there "
            f"is none beside {sys.executable} nor on PATH. Install an MPI "
            "(`pip install mpich`, or load the site's MPI module) and "
            "mpi4py. Received: transport='mpi'"
        )
    return found


def _rank_prefix_options(mpiexec: str) -> tuple[list[str], bool]:
    """(options, relabel) making `mpiexec` prefix lines `[worker <rank>] `.

    Hydra (MPICH, Intel MPI) takes `-prepend-pattern`. Open MPI's
    `--tag-output` tags lines `[<job>,<rank>]<stdout>:`, which `_pump`
    relabels. Other mpiexecs get no options; their lines get `[mpiexec] `.
    """
    try:
        version = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return [], False
    if "HYDRA" in version:
        return ["-prepend-pattern", "[worker %r] "], False
    if "Open MPI" in version or "OpenRTE" in version:
        return ["--tag-output"], True
    return [], False


# Open MPI's `--tag-output` tag: `[1,0]<stdout>: `.
_OPEN_MPI_TAG = re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>:\s?")
# A line that names its worker: `[worker 1] ...`.
_WORKER_PREFIX = re.compile(r"^\[worker (\d+)\] ")
# What a worker that received the preemption signal itself prints
# (training/preemption.py's `leave`, from patches/backup_and_restore.py).
_SIGNALED = re.compile(r"\[keras-replicator\] preempted \((SIG[A-Z0-9]+)\)")


def _mpi_task(command, workers, mpiexec):
    """[(name, argv, env)] of one mpiexec; name None if it prefixes lines."""
    env = {
        k: v
        for k, v in os.environ.items()
        # Ranks find each other through mpi4py (cluster/discovery.py); a
        # TF_CONFIG from the launcher's shell would name another cluster.
        if k != "TF_CONFIG"
    }
    env[transport_lib.ENV] = transport_lib.MPI
    env[CPU_REPLICAS_ENV] = "1"
    env[LAUNCHED_ENV] = "1"
    options, _ = _rank_prefix_options(mpiexec)
    name = None if options else "mpiexec"
    return [(name, [mpiexec, *options, "-n", str(workers), *command], env)]


def _launch_once(
    command,
    workers,
    replicas_per_worker,
    ps,
    say,
    received,
    reaper,
    quiet,
    mpiexec=None,
):
    """One launch: its exit code, whether a port clashed, and was preempted."""
    ports = free_ports(workers)
    tasks = (
        _mpi_task(command, workers, mpiexec)
        if mpiexec
        else _ps_tasks(command, workers, ps, replicas_per_worker)
        if ps
        else [
            (
                f"worker {i}",
                command,
                {
                    **worker_environ(ports, i, replicas_per_worker),
                    # Every worker on this host: see cluster/process_layout.py.
                    LAUNCHED_ENV: "1",
                },
            )
            for i in range(workers)
        ]
    )
    clash = threading.Event()
    # Worker index -> the signal it received itself (what `_pump` read).
    signaled: dict[int, str] = {}
    relabel = bool(mpiexec) and _rank_prefix_options(mpiexec)[1]
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    preempted = False
    try:
        for name, argv, env in tasks:
            if quiet:
                env.setdefault(tf_logs.LEVEL_ENV, tf_logs.QUIET_LEVEL)
            proc = subprocess.Popen(
                list(argv),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Own process group: Ctrl-C reaches the launcher only, and
                # ending a worker ends what it started.
                start_new_session=True,
            )
            procs.append(proc)
            reaper.watch(proc.pid)
            pump = threading.Thread(
                target=_pump,
                args=(
                    proc.stdout,
                    "" if name is None else f"[{name}] ",
                    say,
                    clash,
                    tf_logs.StartupLogFilter() if quiet else None,
                    signaled,
                    relabel,
                ),
                daemon=True,
            )
            pump.start()
            pumps.append(pump)
        # Under parameter servers the chief's exit ends the run: servers
        # never exit, and a dead worker's steps move to the others.
        code, preempted = _wait_all(
            procs[:1] if ps else procs, say, received, procs, signaled
        )
    except KeyboardInterrupt:
        say("[launch] interrupted; ending all workers")
        code = 130
    finally:
        _end_all(procs)
        for proc in procs:
            reaper.forget(proc.pid)
        for pump in pumps:
            pump.join(timeout=_GRACE_SECONDS)
    return code, clash, preempted


def _ps_tasks(command, workers, ps, replicas_per_worker):
    """(name, argv, env) of the chief, workers and ps of a loopback cluster."""
    ports = iter(free_ports(1 + workers + ps))
    cluster = {
        job: [f"{LOOPBACK}:{next(ports)}" for _ in range(count)]
        for job, count in (("chief", 1), ("worker", workers), ("ps", ps))
    }
    tasks = []
    for job, addresses in cluster.items():
        for index in range(len(addresses)):
            env = dict(os.environ)
            env["TF_CONFIG"] = cluster_lib.parse_tf_config(
                {"cluster": cluster, "task": {"type": job, "index": index}}
            ).to_json()
            if replicas_per_worker is not None:
                env[CPU_REPLICAS_ENV] = str(replicas_per_worker)
            argv = command if job == "chief" else SERVE_COMMAND
            name = "chief" if job == "chief" else f"{job} {index}"
            tasks.append((name, argv, env))
    return tasks


def _raise_interrupt(signum, frame):
    del signum, frame
    raise KeyboardInterrupt


def _pump(
    stream,
    prefix,
    say,
    clash: threading.Event,
    startup: tf_logs.StartupLogFilter | None,
    signaled: dict[int, str] | None = None,
    relabel: bool = False,
) -> None:
    """Prints a worker's lines with `prefix`; notes clashes and signals.

    A line saying its worker received the preemption signal itself goes into
    `signaled` (worker index -> signal name). With `relabel`, Open MPI's tags
    become `[worker i] `.
    """
    own_index = _WORKER_PREFIX.match(prefix)
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        if relabel:
            line = _OPEN_MPI_TAG.sub(lambda m: f"[worker {m[1]}] ", line)
        named = _WORKER_PREFIX.match(line)
        if named and not prefix:
            # Hydra prefixes every write, not every line: a line written
            # in pieces (a traceback's carets) repeats the prefix inside.
            line = named[0] + line[named.end() :].replace(named[0], "")
        if any(marker in line for marker in PORT_CLASH):
            clash.set()
        found = _SIGNALED.search(line)
        if found and signaled is not None:
            named = own_index or _WORKER_PREFIX.match(line)
            if named:
                signaled.setdefault(int(named[1]), found[1])
        if startup is None or startup.keep(_WORKER_PREFIX.sub("", line)):
            say(prefix + line)
    stream.close()


def _print(out: TextIO, lock: threading.Lock, line: str) -> None:
    with lock:
        out.write(line + "\n")
        out.flush()


def _exit_code(returncode: int) -> int:
    # Popen reports death by signal N as -N; shells report 128 + N.
    return 128 - returncode if returncode < 0 else returncode


def _wait_all(
    procs, say, received, everyone, signaled=None
) -> tuple[int, bool]:
    """Waits for `procs`; returns the exit code and whether preempted."""
    while True:
        if received:
            name = preemption.signal_name(received[0])
            say(
                f"[launch] received {name}; forwarding it to every worker, "
                f"which save and exit (at most {PREEMPT_GRACE_SECONDS:.0f} "
                "s)",
            )
            for proc in everyone:
                _signal_group(proc, received[0])
            return _wait_preempted(procs, say), True
        running = False
        for index, proc in enumerate(procs):
            code = proc.poll()
            if code is None:
                running = True
            elif code == preemption.EXIT_CODE:
                # Every worker exits so once they agree; the first out need
                # not be the one signalled, whose own line names it (`_pump`).
                _wait_for_exits(procs, _SIGNALED_LINE_SECONDS)
                say(_preempted_line(index, code, signaled))
                return _wait_preempted(procs, say), True
            elif code == hang_watchdog.EXIT_CODE:
                say(
                    f"[launch] worker {index} was ended by the hang watchdog "
                    f"(exit code {code}; its stacks are above); the others "
                    f"get {HANG_GRACE_SECONDS:.0f} s to print theirs, then "
                    "are ended",
                )
                _wait_for_exits(procs, HANG_GRACE_SECONDS)
                return code, False
            elif code != 0:
                say(
                    f"[launch] worker {index} exited with code "
                    f"{_exit_code(code)}; ending the other workers",
                )
                return _exit_code(code), False
        if not running:
            return 0, False
        time.sleep(0.1)


# Seconds to wait for the others (and the signalled worker's line) before
# reporting a preemption.
_SIGNALED_LINE_SECONDS = 5.0


def _preempted_line(index, code, signaled) -> str:
    """What the launcher says of a preemption: the worker that got it."""
    if signaled:
        worker = min(signaled)
        return (
            f"[launch] worker {worker} received {signaled[worker]} and every "
            f"worker saved and left (exit code {code}); waiting for the "
            "others to exit"
        )
    return (
        f"[launch] worker {index} was preempted (exit code {code}); waiting "
        "for the others to save and exit"
    )


def _wait_for_exits(procs, seconds: float) -> None:
    """Waits up to `seconds` for every process in `procs` to exit."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)


def _wait_preempted(procs, say) -> int:
    """Gives preempted workers the grace period; their common exit code."""
    _wait_for_exits(procs, PREEMPT_GRACE_SECONDS)
    codes = []
    for index, proc in enumerate(procs):
        if proc.poll() is None:
            say(
                f"[launch] worker {index} did not exit within "
                f"{PREEMPT_GRACE_SECONDS:.0f} s; killing it",
            )
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        codes.append(_exit_code(proc.returncode))
    failed = [c for c in codes if c not in (0, preemption.EXIT_CODE)]
    return failed[0] if failed else preemption.EXIT_CODE


def _end_all(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_SECONDS
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
