"""The `keras-replicator` command: env and demo, as a user runs them."""

import os
import re
import subprocess
import sys

import pytest

from keras_replicator._src.cluster import cli


def _run(*args, timeout=300, env=None):
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "keras_replicator._src.cluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def test_env_says_what_auto_picks_and_why():
    result = _run("env", env={"KERAS_REPLICATOR_CPU_REPLICAS": "3"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "auto() picks: LocalReplicator(num_replicas=3)" in result.stdout
    assert "KERAS_REPLICATOR_CPU_REPLICAS" in result.stdout


def test_env_rejects_bad_cpu_replica_variable():
    result = _run("env", env={"KERAS_REPLICATOR_CPU_REPLICAS": "zero"})
    assert result.returncode != 0
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
    assert "Epoch 1/" in result.stdout  # the Keras progress output


def test_parser_rejects_non_positive_replicas(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--replicas", "0"])
    assert "Received: '0'" in capsys.readouterr().err
