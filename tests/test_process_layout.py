"""The one-host layout advice, where it applies and only there.

`keras-replicator launch` itself says nothing about layouts: the chief
worker's `MultiWorkerReplicator()` gives the one-process advice, in one
line, unless `keras.distribution` built it (one device per process can be
the point of several processes there).
"""

import sys
import textwrap

import pytest

from keras_replicator._src.cli import main as cli
from keras_replicator._src.cluster import config as cluster_lib
from keras_replicator._src.cluster import process_layout
from keras_replicator._src.core import env
from tests.multi_worker import harness

ADVICE = "keras-replicator: 2 worker processes on this host"


def test_the_advice_is_one_line_with_the_one_process_command():
    advice = process_layout.one_process_advice(
        4, 1, "CPU", ["train.py", "--epochs=3"]
    )
    assert advice.startswith("keras-replicator: 4 worker processes on this")
    assert "one process with all 4 replicas is faster" in advice
    assert advice.endswith(
        "run: KERAS_REPLICATOR_CPU_REPLICAS=4 python train.py --epochs=3"
    )
    assert "1.34x" in advice
    assert "\n" not in advice


def test_the_advice_counts_every_replica_and_quotes_the_command():
    advice = process_layout.one_process_advice(2, 3, "CPU", ["my train.py"])
    assert "all 6 replicas" in advice
    assert advice.endswith(
        "KERAS_REPLICATOR_CPU_REPLICAS=6 python 'my train.py'"
    )
    # GPUs: one process takes every GPU it sees, no variable needed.
    advice = process_layout.one_process_advice(2, 1, "GPU", ["train.py"])
    assert advice.endswith("run: python train.py")


def _config(index, workers=2):
    hosts = [f"127.0.0.1:{2000 + i}" for i in range(workers)]
    return cluster_lib.make_tf_config(hosts, index)


def test_the_advice_only_on_the_chief_of_a_launch_once(monkeypatch, capsys):
    monkeypatch.setattr(process_layout, "_advised", False)
    monkeypatch.delenv(env.LAUNCHED, raising=False)
    process_layout.advise_once(_config(0), "CPU", 1)  # not started by launch
    monkeypatch.setenv(env.LAUNCHED, "1")
    process_layout.advise_once(_config(1), "CPU", 1)  # not the chief
    process_layout.advise_once(_config(0, workers=1), "CPU", 2)  # one process
    with process_layout.for_keras_distribution():
        process_layout.advise_once(_config(0), "CPU", 1)  # Keras' replicator
    assert capsys.readouterr() == ("", "")
    process_layout.advise_once(_config(0), "CPU", 1)
    process_layout.advise_once(_config(0), "CPU", 1)  # built again: said once
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(ADVICE), err


def test_launch_prints_no_layout_banner(capsys):
    command = [sys.executable, "-c", "print('trained')"]
    assert cli.main(["launch", "--workers", "2", "--", *command]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == ["[worker 0] trained", "[worker 1] trained"]


# keras.distribution's replicator first (no advice), then the script's own
# (the advice, on the chief only), in one run of 2 workers.
SCRIPT = textwrap.dedent(
    """
    import keras
    import keras_replicator as kr

    keras.distribution.initialize()
    print("initialized", flush=True)
    kr.MultiWorkerReplicator()
    print("built", flush=True)
    """
)


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_a_launched_script_is_advised_once_unless_keras_distribution(
    tmp_path,
):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc, _ = harness.run_launcher(script, replicas_per_worker=1, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = proc.stdout.splitlines()
    advice = [line for line in lines if "worker processes on this" in line]
    assert len(advice) == 1, lines
    assert advice[0].startswith(f"[worker 0] {ADVICE}"), advice
    assert advice[0].endswith(
        f"KERAS_REPLICATOR_CPU_REPLICAS=2 python {script}"
    ), advice
    chief = [line for line in lines if line.startswith("[worker 0] ")]
    assert chief.index("[worker 0] initialized") < chief.index(advice[0])
    assert chief.index(advice[0]) < chief.index("[worker 0] built")
