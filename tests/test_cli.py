"""The `keras-replicator` command: help, env and demo, as a user runs them."""

import os
import re
import resource
import subprocess
import sys

import pytest

from keras_replicator._src.cli import main as cli
from keras_replicator._src.cluster import tf_logs
from keras_replicator._src.core import devices
from tests.multi_worker import harness

# What TensorFlow's C++ start-up logs contain on a CPU machine.
TF_LOG_MARKERS = (
    "cuInit",
    "oneDNN",
    "cpu_feature_guard",
    "cudart_stub",
    "absl",
    "I0000",
    "E0000",
    "W0000",
)
HELP = (
    (),
    ("demo",),
    ("env",),
    ("launch",),
    ("checkpoint",),
    ("tf-config",),
)


def _run(*args, timeout=300, env=None):
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "keras_replicator._src.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def _user_env():
    """A user's environment: no TF_CPP_MIN_LOG_LEVEL, this checkout first."""
    env = dict(os.environ, PYTHONPATH=str(harness.REPO_ROOT))
    env.pop(tf_logs.LEVEL_ENV, None)
    return env


def _tf_log_lines(text):
    return [
        line
        for line in text.splitlines()
        if any(marker in line for marker in TF_LOG_MARKERS)
    ]


@pytest.mark.parametrize("command", HELP, ids=lambda c: " ".join(c) or "-")
def test_help_is_quick_and_prints_only_help(command):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(
        [*harness.command_line(), *command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_user_env(),
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # The help's own CPU time: wall time on a loaded machine measures the
    # other processes too.
    seconds = (after.ru_utime + after.ru_stime) - (
        before.ru_utime + before.ru_stime
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: keras-replicator"), result.stdout
    assert result.stderr == ""
    assert not _tf_log_lines(result.stdout)
    # Importing TensorFlow alone takes 4-8 s of CPU on a 2-core machine,
    # the help without it about 0.2 s.
    assert seconds < 2, f"{seconds:.1f} s of CPU"


def _option_help(text, option):
    """The help of `option` in a --help text, on one line."""
    lines = text.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.lstrip().startswith(option)
    )
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if line.lstrip().startswith("-") or not line.startswith(" "):
            break
        block.append(line)
    return " ".join(" ".join(block).split())


@pytest.mark.parametrize("command", HELP[1:], ids=lambda c: " ".join(c))
def test_help_shows_every_options_default(command, capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--help"])
    text = capsys.readouterr().out
    (subcommand,) = command
    sub = parser._subparsers._group_actions[0].choices[subcommand]
    for action in sub._actions:
        if not action.option_strings or action.required:
            continue
        if action.dest == "help":
            continue
        shown = _option_help(text, action.option_strings[0])
        if action.default is None:
            # A default read from elsewhere is spelled out.
            assert "default: " in shown, shown
        elif action.default is False:
            assert shown.endswith("(default: off)"), shown
        else:
            assert shown.endswith(f"(default: {action.default})"), shown


@pytest.mark.parametrize("how", ["script", "module"])
@pytest.mark.parametrize("command", HELP, ids=lambda c: " ".join(c) or "-")
def test_help_imports_no_tensorflow(how, command):
    # `-X importtime` lists every module the process imports, on stderr.
    if how == "script":
        entry = harness.command_line()
        if len(entry) > 1:
            pytest.skip("keras-replicator is not installed next to python")
        argv = [sys.executable, "-X", "importtime", entry[0]]
    else:
        argv = [sys.executable, "-X", "importtime", "-m", cli.__name__]
    result = subprocess.run(
        [*argv, *command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_user_env(),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {
        line.rpartition("|")[2].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    # The package's __init__ ran: it is what imported TensorFlow before.
    assert "keras_replicator" in imported
    heavy = sorted(
        name
        for name in imported
        if name.split(".")[0] in ("tensorflow", "keras")
    )
    assert not heavy, heavy[:10]


def test_the_commands_process_loads_the_package_on_first_use():
    # The command's process as the console script starts it (argv[0] is
    # its path while it imports the CLI): the package waits for a name.
    program = (
        "import sys\n"
        "sys.argv[0] = '/some/venv/bin/keras-replicator'\n"
        "import keras_replicator as kr\n"
        "from keras_replicator._src.cli import main as cli\n"
        "assert 'tensorflow' not in sys.modules\n"
        "from keras_replicator import LocalReplicator\n"
        "assert 'tensorflow' in sys.modules\n"
        "assert kr.LocalReplicator is LocalReplicator\n"
        "missing = [n for n in kr.__all__ if not hasattr(kr, n)]\n"
        "print('missing', missing)\n"
        "try:\n"
        "    kr.no_such_name\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(_user_env(), TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "missing []",
        "module 'keras_replicator' has no attribute 'no_such_name'",
    ]


def _cpu_seconds_of(argv, env):
    """Runs `argv`; returns the result and the CPU time it took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env=env
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = (after.ru_utime + after.ru_stime) - (
        before.ru_utime + before.ru_stime
    )
    return result, seconds


@pytest.mark.skipif(
    devices.gpus_possible() is not None,
    reason="a GPU may be here: env asks TensorFlow",
)
def test_env_is_quick_and_imports_no_tensorflow_where_no_gpu_can_be():
    result, seconds = _cpu_seconds_of(
        [sys.executable, "-X", "importtime", "-m", cli.__name__, "env"],
        _user_env(),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {
        line.rpartition("|")[2].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    heavy = sorted(
        name
        for name in imported
        if name.split(".")[0] in ("tensorflow", "keras")
    )
    assert not heavy, heavy[:10]
    # What auto() picks, why, and what the devices are, all the same.
    lines = result.stdout.splitlines()
    assert lines[0].startswith("tensorflow 2."), lines
    assert lines[1].startswith("devices: "), lines
    assert "no GPU" in lines[1] and "without importing TensorFlow" in lines[1]
    assert lines[2].startswith("auto() picks: LocalReplicator("), lines
    assert lines[3] == (
        "transport: grpc, as no mpiexec or srun --mpi started this job "
        "(the default)"
    ), lines
    # Its CPU time, robust on a loaded machine (wall time counts the other
    # processes): importing TensorFlow alone takes 4-8 s of CPU on a
    # 2-core machine, env without it about 0.2 s.
    assert seconds < 3, f"{seconds:.1f} s of CPU"


def test_env_hides_tensorflow_logs_unless_verbose():
    # --tensorflow: TensorFlow is imported, so it has logs to hide.
    quiet = subprocess.run(
        [*harness.command_line(), "env", "--tensorflow"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_user_env(),
    )
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "auto() picks: " in quiet.stdout
    assert "(TensorFlow's physical devices)" in quiet.stdout
    assert not _tf_log_lines(quiet.stdout + quiet.stderr), quiet.stderr
    verbose = subprocess.run(
        [*harness.command_line(), "env", "--tensorflow", "--verbose"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_user_env(),
    )
    assert verbose.returncode == 0, verbose.stderr[-2000:]
    assert verbose.stdout == quiet.stdout
    # TensorFlow 2.21 on a CPU writes its start-up lines (the quiet run is
    # not quiet by chance); a TensorFlow that stops writing them fails here.
    startup = tf_logs.StartupLogFilter()
    hidden = [
        line for line in verbose.stderr.splitlines() if not startup.keep(line)
    ]
    assert hidden, verbose.stderr


def test_env_says_what_auto_picks_and_why():
    result = _run("env", env={"KERAS_REPLICATOR_CPU_REPLICAS": "3"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "auto() picks: LocalReplicator(num_replicas=3)" in result.stdout
    assert "KERAS_REPLICATOR_CPU_REPLICAS" in result.stdout


def test_env_rejects_bad_cpu_replica_variable():
    result = _run("env", env={"KERAS_REPLICATOR_CPU_REPLICAS": "zero"})
    assert result.returncode == 2
    assert result.stderr.startswith("keras-replicator env: error: ")
    assert "Received: KERAS_REPLICATOR_CPU_REPLICAS='zero'" in result.stderr


def test_demo_reaches_95_percent_on_1_and_2_replicas():
    result = _run("demo", "--replicas", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = re.findall(
        r"^\s+(\d+)\s+([\d.]+)%\s+(\d+)\s+([\d.]+)x$", result.stdout, re.M
    )
    assert [int(r[0]) for r in rows] == [1, 2], result.stdout[-2000:]
    for _, accuracy, examples_per_sec, _ in rows:
        assert float(accuracy) >= 95.0
        assert int(examples_per_sec) > 0
    # The same model, data and global batch: the same accuracy, as printed.
    assert rows[0][1] == rows[1][1], result.stdout[-2000:]
    assert "Epoch 1/" in result.stdout  # the Keras progress output


def test_parser_rejects_non_positive_replicas(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--replicas", "0"])
    assert "Received: '0'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, received",
    [
        (("--replicas-per-worker", "2"), "Received: replicas_per_worker=2"),
        (("--ps", "1"), "Received: ps=1"),
    ],
)
def test_launch_mpi_refuses_what_mpi_cannot_carry(option, received, capsys):
    code = cli.main(
        ["launch", "--workers", "2", "--transport", "mpi", *option]
        + ["--", sys.executable, "-c", "pass"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "--transport mpi" in err and received in err


@pytest.mark.parametrize(
    "environ, launched",
    [
        ({}, False),
        ({"PMI_RANK": "1"}, True),
        ({"OMPI_COMM_WORLD_RANK": "0"}, True),
        ({"SLURM_PROCID": "3"}, True),
        (
            {
                "TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2"]}, '
                '"task": {"type": "worker", "index": 0}}'
            },
            True,
        ),
        (
            {
                "TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, '
                '"task": {"type": "worker", "index": 0}}'
            },
            False,
        ),
        ({"TF_CONFIG": "not json"}, False),
    ],
)
def test_a_process_of_another_launchers_job_is_quieted(environ, launched):
    # mpiexec, srun and a TF_CONFIG job of several tasks: their processes
    # import keras_replicator with TensorFlow's C++ start-up logs hidden,
    # as `keras-replicator launch` starts its workers
    # (tests/multi_worker/test_output.py shows it under mpiexec).
    assert tf_logs.launched(environ) is launched
