"""Workers die with their launcher, however it dies (`cluster/reaper.py`).

A `keras-replicator launch` process and a script calling `kr.launch` are
each killed with SIGKILL, which no handler sees, while their workers
sleep; no worker may be left. The workers run no TensorFlow op.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from keras_replicator._src.cluster import reaper
from tests.multi_worker import harness

# Writes its pid to <folder>/<pid> and sleeps; a worker of either launcher.
SLEEPER = textwrap.dedent(
    """
    import os, sys, time

    def sleeper(folder):
        open(os.path.join(folder, str(os.getpid())), "w").close()
        time.sleep(600)

    if __name__ == "__main__":
        sleeper(sys.argv[1])
    """
)
CALLER = textwrap.dedent(
    """
    import sys
    import keras_replicator as kr
    from sleeper import sleeper

    kr.launch(sleeper, sys.argv[1], workers=2)
    """
)


def _wait_for_pids(folder, count, run, timeout=120):
    """The workers' pids, once all `count` wrote them."""
    deadline = time.monotonic() + timeout
    while len(list(folder.iterdir())) < count:
        assert run.proc.poll() is None, run.output()[-4000:]
        assert time.monotonic() < deadline, run.output()[-4000:]
        time.sleep(0.1)
    return [int(p.name) for p in folder.iterdir()]


def _start(command, tmp_path, name):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(harness.REPO_ROOT)]),
    }
    return harness.Background(command, tmp_path, name, env)


@pytest.mark.timeout(180)
def test_launch_killed_with_sigkill_leaves_no_worker(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    folder = tmp_path / "pids"
    folder.mkdir()
    run = _start(
        harness.launch_command(
            tmp_path / "sleeper.py", [str(folder)], num_workers=2
        ),
        tmp_path,
        "launch",
    )
    pids = _wait_for_pids(folder, 2, run)
    os.kill(run.proc.pid, signal.SIGKILL)  # the launcher alone
    run.proc.wait(timeout=30)
    assert harness.wait_until_gone(pids) == [], run.output()[-4000:]


@pytest.mark.timeout(180)
def test_a_kr_launch_caller_killed_with_sigkill_leaves_no_worker(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "caller.py").write_text(CALLER)
    folder = tmp_path / "pids"
    folder.mkdir()
    run = _start(
        [sys.executable, str(tmp_path / "caller.py"), str(folder)],
        tmp_path,
        "caller",
    )
    pids = _wait_for_pids(folder, 2, run)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(timeout=30)
    assert harness.wait_until_gone(pids) == [], run.output()[-4000:]


@pytest.mark.timeout(180)
def test_an_mpi_launch_killed_with_sigkill_leaves_no_rank(tmp_path):
    """`--transport mpi`: the launcher starts mpiexec, which starts the
    ranks; killing the launcher alone ends mpiexec and every rank."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    folder = tmp_path / "pids"
    folder.mkdir()
    command = harness.launch_command(
        tmp_path / "sleeper.py",
        [str(folder)],
        num_workers=2,
        replicas_per_worker=1,
    )
    at = command.index("launch") + 1
    command[at:at] = ["--transport", "mpi"]
    env = harness.mpiexec_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(harness.REPO_ROOT)])
    run = harness.Background(command, tmp_path, "mpi_launch", env)
    pids = _wait_for_pids(folder, 2, run)
    os.kill(run.proc.pid, signal.SIGKILL)  # the launcher alone
    run.proc.wait(timeout=30)
    assert harness.wait_until_gone(pids) == [], run.output()[-4000:]
    # mpiexec is gone too: no process is left with the folder in its
    # command line.
    deadline = time.monotonic() + 30
    while _with_argument(str(folder)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _with_argument(str(folder)) == [], run.output()[-4000:]


def _with_argument(text):
    """Pids of live processes with `text` in their command line (Linux)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                line = f.read().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if entry.isdigit() and text in line:
            found.append(int(entry))
    return found


def test_a_closed_reaper_kills_nothing(tmp_path):
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        start_new_session=True,
    )
    try:
        with reaper.Reaper() as watcher:
            watcher.watch(sleeper.pid)
        # Said goodbye: the launcher ends its workers itself.
        assert harness.alive(sleeper.pid)
        with reaper.Reaper() as watcher:
            watcher.watch(sleeper.pid)
            watcher.forget(sleeper.pid)
            # Its pipe closes without goodbye, as when the launcher dies.
            watcher._proc.stdin.close()
            watcher._proc.wait(timeout=30)
        assert harness.alive(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
