"""The one-host layout advice: `launch`'s `[launch]` hint, as users see it."""

import shlex
import sys

from keras_replicator._src.cluster import cli
from keras_replicator._src.cluster import layout


def test_hint_gives_the_one_process_command_with_every_replica():
    hint = layout.launch_hint(["python", "train.py", "--epochs", "3"], 4)
    assert hint.startswith("[launch] all 4 workers run on this host")
    assert "one process with 4 replicas is faster" in hint
    assert (
        "run: KERAS_REPLICATOR_CPU_REPLICAS=4 python train.py --epochs 3"
        in (hint)
    )
    assert "1.34x" in hint
    assert "\n" not in hint


def test_hint_counts_replicas_of_every_worker_and_quotes_the_command():
    hint = layout.launch_hint(["python", "my train.py"], 2, 3)
    assert "one process with 6 replicas" in hint
    assert "KERAS_REPLICATOR_CPU_REPLICAS=6 python 'my train.py'" in hint


def test_no_hint_for_one_worker_or_parameter_servers():
    assert layout.launch_hint(["python", "t.py"], 1) is None
    assert layout.launch_hint(["python", "t.py"], 1, 4) is None
    assert layout.launch_hint(["python", "t.py"], 2, ps=1) is None


def test_launch_two_workers_prints_the_hint_first(capsys):
    command = [sys.executable, "-c", "print('trained')"]
    assert cli.main(["launch", "--workers", "2", "--", *command]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == layout.launch_hint(command, 2)
    assert f"KERAS_REPLICATOR_CPU_REPLICAS=2 {shlex.join(command)}" in lines[0]
    assert sorted(lines[1:]) == ["[worker 0] trained", "[worker 1] trained"]


def test_launch_one_worker_prints_no_hint(capsys):
    command = [sys.executable, "-c", "print('trained')"]
    assert cli.main(["launch", "--workers", "1", "--", *command]) == 0
    assert "[launch]" not in capsys.readouterr().out
