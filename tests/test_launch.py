"""`keras-replicator launch`: output prefixes, failures, Ctrl-C, arguments.

These use tiny Python programs (no TensorFlow), so they are fast; training
runs through the launcher are in tests/multi_worker/ (test_faults.py, and
test_launch_fresh_shell.py for `python` outside the virtual environment).
"""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from keras_replicator._src.cli import main as cli
from keras_replicator._src.cluster import launch
from tests.multi_worker import harness

SHOW_CONFIG = (
    "import json, os; c = json.loads(os.environ['TF_CONFIG']); "
    "print(c['task']['index'], ','.join(c['cluster']['worker']), "
    "os.environ.get('KERAS_REPLICATOR_CPU_REPLICAS'))"
)


def test_each_worker_gets_its_tf_config_on_loopback():
    out = io.StringIO()
    code = launch.launch(
        [sys.executable, "-c", SHOW_CONFIG],
        workers=3,
        replicas_per_worker=2,
        out=out,
    )
    assert code == 0
    lines = sorted(out.getvalue().splitlines())
    assert [line.split()[:2] for line in lines] == [
        ["[worker", "0]"],
        ["[worker", "1]"],
        ["[worker", "2]"],
    ]
    hosts = {line.split()[3] for line in lines}
    assert len(hosts) == 1
    addresses = hosts.pop().split(",")
    assert len(set(addresses)) == 3
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    assert [line.split()[2] for line in lines] == ["0", "1", "2"]
    assert all(line.endswith(" 2") for line in lines)


def test_a_failure_ends_the_others_and_returns_its_code():
    program = (
        "import json, os, time\n"
        "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "if index == 1:\n"
        "    raise SystemExit(7)\n"
        "time.sleep(120)\n"
    )
    out = io.StringIO()
    start = time.monotonic()
    code = launch.launch([sys.executable, "-c", program], workers=3, out=out)
    assert code == 7
    assert time.monotonic() - start < 30
    assert "worker 1 exited with code 7" in out.getvalue()


def test_a_killed_worker_gives_128_plus_signal():
    program = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    code = launch.launch([sys.executable, "-c", program], workers=1)
    assert code == 128 + signal.SIGKILL


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_every_worker(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    program = (
        "import os, sys, time\n"
        f"open(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\n"
        "time.sleep(120)\n"
    )
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keras_replicator._src.cli.main",
            "launch",
            "--workers",
            "2",
            "--",
            sys.executable,
            "-c",
            program,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Ctrl-C reaches the launcher as in a terminal, even when the tests
        # run in the background with SIGINT ignored (inherited otherwise).
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(os.listdir(pids)) == 2
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 130
    finally:
        launcher.kill()
    for pid in map(int, os.listdir(pids)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


BIND_MY_PORT = (
    "import json, os, socket, sys; c = json.loads(os.environ['TF_CONFIG']); "
    "host, port = c['cluster']['worker'][c['task']['index']].split(':'); "
    "s = socket.socket(); s.bind((host, int(port))); print('bound', port)"
)


def test_a_taken_port_restarts_every_worker_on_new_ports(monkeypatch):
    # Another process takes worker 1's port between the pick and the bind:
    # the worker fails ("[Errno 98] Address already in use") and the
    # launcher starts all workers again on new ports.
    taken = socket.socket()
    taken.bind((launch.LOOPBACK, 0))
    taken.listen()
    picks = []
    real_free_ports = launch.free_ports

    def free_ports(count):
        ports = real_free_ports(count)
        if not picks:
            ports[1] = taken.getsockname()[1]
        picks.append(ports)
        return ports

    monkeypatch.setattr(launch, "free_ports", free_ports)
    out = io.StringIO()
    try:
        code = launch.launch(
            [sys.executable, "-c", BIND_MY_PORT], workers=2, out=out
        )
    finally:
        taken.close()
    text = out.getvalue()
    assert code == 0, text
    assert len(picks) == 2, text
    assert "Address already in use" in text
    assert "starting all workers again on new ports (2 of 3)" in text
    assert f"[worker 1] bound {picks[1][1]}" in text


def test_other_failures_are_not_retried():
    out = io.StringIO()
    program = "import sys; print('no such file'); sys.exit(3)"
    assert (
        launch.launch([sys.executable, "-c", program], workers=2, out=out) == 3
    )
    assert "again on new ports" not in out.getvalue()


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"Received: command=\[\]"):
        launch.launch([], workers=2)
    with pytest.raises(ValueError, match="Received: workers=0"):
        launch.launch(["true"], workers=0)
    with pytest.raises(ValueError, match="Received: ps=-1"):
        launch.launch(["true"], workers=1, ps=-1)
    assert cli.main(["launch", "--workers", "2"]) == 2


def test_worker_environ_is_valid_tf_config():
    env = launch.worker_environ([1234, 1235], 1, base={})
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"worker": ["127.0.0.1:1234", "127.0.0.1:1235"]},
        "task": {"type": "worker", "index": 1},
    }


# What TensorFlow 2.21 writes while it loads, before TF_CPP_MIN_LOG_LEVEL
# applies, followed by a worker's own output (an absl-py log line included).
STARTUP_LOGS = (
    "import os, sys\n"
    "err = sys.stderr\n"
    "err.write('WARNING: All log messages before absl::InitializeLog() is "
    "called are written to STDERR\\n')\n"
    "err.write('I0000 00:00:1795696317.909375    6487 port.cc:153] oneDNN "
    "custom operations are on.\\n')\n"
    "err.write('I0000 00:00:1795696317.986947    6487 "
    "cpu_feature_guard.cc:227] This TensorFlow binary is optimized.\\n')\n"
    "err.write('To enable the following instructions: AVX2 FMA, rebuild.\\n')\n"
    "err.write('E0000 00:00:1795696323.134423    6487 cuda_platform.cc:52] "
    "failed call to cuInit\\n')\n"
    "err.flush()\n"
    "print('I0925 14:03:12.345678 140000 train.py:10] my absl-py line')\n"
    "print('loss 0.25, level', os.environ.get('TF_CPP_MIN_LOG_LEVEL'))\n"
)


def test_quiet_launch_hides_tensorflow_start_up_logs(monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    out = io.StringIO()
    code = launch.launch(
        [sys.executable, "-c", STARTUP_LOGS], workers=2, out=out, quiet=True
    )
    assert code == 0, out.getvalue()
    lines = sorted(out.getvalue().splitlines())
    assert lines == [
        "[worker 0] I0925 14:03:12.345678 140000 train.py:10] my absl-py line",
        "[worker 0] loss 0.25, level 3",
        "[worker 1] I0925 14:03:12.345678 140000 train.py:10] my absl-py line",
        "[worker 1] loss 0.25, level 3",
    ]


def test_launch_shows_tensorflow_logs_by_default(monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    out = io.StringIO()
    code = launch.launch(
        [sys.executable, "-c", STARTUP_LOGS], workers=1, out=out
    )
    assert code == 0
    text = out.getvalue()
    assert "[worker 0] loss 0.25, level None" in text
    for shown in (
        "absl::InitializeLog",
        "port.cc",
        "cpu_feature_guard",
        "To enable the following",
        "cuInit",
    ):
        assert shown in text


@pytest.mark.parametrize(
    ("flags", "user_level", "level", "hidden"),
    [
        ((), None, "3", True),
        (("--verbose",), None, "None", False),
        ((), "1", "1", False),
    ],
    ids=["default", "verbose", "user-level"],
)
def test_cli_launch_is_quiet_unless_verbose_or_level_set(
    monkeypatch, capfd, flags, user_level, level, hidden
):
    if user_level is None:
        monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", user_level)
    code = cli.main(
        [
            "launch",
            "--workers",
            "1",
            *flags,
            "--",
            sys.executable,
            "-c",
            STARTUP_LOGS,
        ]
    )
    assert code == 0
    text = capfd.readouterr().out
    assert f"[worker 0] loss 0.25, level {level}" in text
    assert ("cuInit" in text) is not hidden
    assert ("absl::InitializeLog" in text) is not hidden


@pytest.mark.parametrize(
    ("command", "script"),
    [
        (["python", "train.py", "--epochs", "3"], "train.py"),
        (["python3", "-u", "train.py"], "train.py"),
        (["python3.11", "-X", "importtime", "-B", "t.py"], "t.py"),
        (["python", "-Ximporttime", "-Wignore", "t.py"], "t.py"),
        (["python", "-W", "ignore", "t.py", "-m", "x"], "t.py"),
        (
            ["/usr/bin/python3", "--check-hash-based-pycs", "never", "t.py"],
            "t.py",
        ),
        (["python", "-m", "pkg.train"], None),
        (["python", "-mpkg.train"], None),
        (["python", "-c", "print(1)"], None),
        (["python", "-uc", "print(1)"], None),
        (["python", "-"], None),
        (["python"], None),
        (["bash", "train.sh"], None),
        (["pythonista", "train.py"], None),
    ],
)
def test_python_script_is_the_first_argument_after_options(command, script):
    assert launch.python_script(command) == script


def _fake_python_on_path(monkeypatch, tmp_path):
    """Puts a `python` that is not this interpreter first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return fake


def test_a_python_that_is_not_ours_runs_on_ours(monkeypatch, tmp_path):
    fake = _fake_python_on_path(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    command, note = launch.prepare_command(["python", "-u", "train.py", "x"])
    assert command == [sys.executable, "-u", "train.py", "x"]
    assert note.startswith("[launch] `python` is ")
    assert str(fake) in note and sys.executable in note
    assert "--no-python-swap" in note
    assert "\n" not in note
    kept, note = launch.prepare_command(["python", "train.py"], False)
    assert (kept, note) == (["python", "train.py"], None)


def test_python_not_on_path_runs_on_ours(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    command, note = launch.prepare_command(["python3", "-c", "pass"])
    assert command == [sys.executable, "-c", "pass"]
    assert "`python3` is not on PATH" in note


def test_our_own_python_and_explicit_paths_are_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    name = os.path.basename(sys.executable)
    assert launch.prepare_command([name, "-c", "pass"]) == (
        [name, "-c", "pass"],
        None,
    )
    fake = _fake_python_on_path(monkeypatch, tmp_path)
    assert launch.prepare_command([str(fake), "-c", "pass"]) == (
        [str(fake), "-c", "pass"],
        None,
    )
    assert launch.prepare_command(["echo", "hi"]) == (["echo", "hi"], None)


def test_launch_runs_python_on_ours_and_says_so(monkeypatch, tmp_path, capsys):
    _fake_python_on_path(monkeypatch, tmp_path)
    out = io.StringIO()
    code = launch.launch(
        ["python", "-c", "import sys; print(sys.executable)"],
        workers=2,
        out=out,
    )
    assert code == 0, out.getvalue()
    assert sorted(out.getvalue().splitlines()) == [
        f"[worker 0] {sys.executable}",
        f"[worker 1] {sys.executable}",
    ]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("[launch] `python` is "), err


def test_a_missing_script_starts_nothing(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(
        launch.subprocess, "Popen", lambda *a, **k: started.append(a)
    )
    with pytest.raises(ValueError, match=r"Received: script='trian\.py'"):
        launch.launch([sys.executable, "trian.py"], workers=2)
    with pytest.raises(ValueError, match=str(tmp_path)):
        launch.launch(["python", "-u", "trian.py"], workers=2, ps=1)
    assert started == []


def test_cli_fails_on_a_missing_script_before_any_worker(tmp_path):
    start = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_replicator._src.cli.main",
            "launch",
            "--workers",
            "2",
            "--",
            "python",
            "no_such_train.py",
            "--epochs",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(harness.REPO_ROOT)),
    )
    assert result.returncode == 2
    assert result.stdout == ""  # no worker output, no hint
    assert "keras-replicator launch: error: " in result.stderr
    assert "Received: script='no_such_train.py'" in result.stderr
    assert "no worker was started" in result.stderr
    assert time.monotonic() - start < 30
