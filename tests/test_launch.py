"""`keras-replicator launch`: output prefixes, failures, Ctrl-C, arguments.

These use tiny Python programs (no TensorFlow), so they are fast; the
training run through the launcher is in tests/multi_worker/test_launch_fit.py.
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

from keras_replicator._src.cluster import cli
from keras_replicator._src.cluster import launch

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
            "keras_replicator._src.cluster.cli",
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
