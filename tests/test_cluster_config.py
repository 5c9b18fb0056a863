"""TF_CONFIG / Slurm detection and validation; the tf-config command."""

import json

import pytest

import keras_replicator as kr
from keras_replicator._src.cli import main as cli
from keras_replicator._src.cluster import config as cluster
from keras_replicator._src.replicators import auto

GOOD = {
    "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
    "task": {"type": "worker", "index": 1},
}


def test_parses_a_good_tf_config():
    config = cluster.parse_tf_config(json.dumps(GOOD))
    assert config.num_workers == 2
    assert config.worker_index == 1
    assert not config.is_chief
    assert json.loads(config.to_json()) == GOOD


def test_chief_job_is_worker_zero():
    config = cluster.parse_tf_config(
        {
            "cluster": {"chief": ["a:1"], "worker": ["b:1", "c:1"]},
            "task": {"type": "worker", "index": 0},
        }
    )
    assert (config.num_workers, config.worker_index) == (3, 1)
    assert not config.is_chief


@pytest.mark.parametrize(
    "text, quoted",
    [
        ("{not json", "TF_CONFIG='{not json'"),
        ("[1, 2]", "TF_CONFIG=[1, 2]"),
        (json.dumps({"task": GOOD["task"]}), "cluster=None"),
        (json.dumps({"cluster": GOOD["cluster"]}), "task=None"),
        (
            json.dumps({**GOOD, "task": {"type": "chief", "index": 0}}),
            "task.type='chief'",
        ),
        (
            json.dumps({**GOOD, "task": {"type": "worker", "index": 2}}),
            "task.index=2",
        ),
        (
            json.dumps({**GOOD, "task": {"type": "worker", "index": "0"}}),
            "task.index='0'",
        ),
        (
            json.dumps({**GOOD, "cluster": {"worker": ["h:1", "h:2", "h:1"]}}),
            "cluster['worker'][2]='h:1'",
        ),
        (
            json.dumps({**GOOD, "cluster": {"worker": ["h:1", "nohost"]}}),
            "cluster['worker'][1]='nohost'",
        ),
        (
            json.dumps({**GOOD, "cluster": {"trainer": ["h:1"]}}),
            "cluster['trainer']",
        ),
    ],
)
def test_malformed_tf_config_names_the_bad_field(text, quoted):
    with pytest.raises(ValueError) as info:
        cluster.parse_tf_config(text)
    assert f"Received: {quoted}" in str(info.value)


def test_replicator_rejects_malformed_tf_config_before_touching_tf(
    monkeypatch,
):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": GOOD["cluster"]}))
    with pytest.raises(ValueError, match="Received: task=None"):
        kr.MultiWorkerReplicator()


def test_replicator_without_cluster_says_how_to_get_one(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ValueError, match="keras-replicator launch"):
        kr.MultiWorkerReplicator()


@pytest.mark.parametrize(
    "kwargs, quoted",
    [
        ({"replicas_per_worker": 0}, "replicas_per_worker=0"),
        ({"timeout_seconds": -1}, "timeout_seconds=-1"),
        ({"timeout_seconds": float("nan")}, "timeout_seconds=nan"),
        (
            {"collective_timeout_seconds": "60"},
            "collective_timeout_seconds='60'",
        ),
        ({"cluster": 3}, "cluster=3"),
    ],
)
def test_replicator_rejects_bad_arguments(kwargs, quoted):
    with pytest.raises((ValueError, TypeError), match=f"Received: {quoted}"):
        kr.MultiWorkerReplicator(**kwargs)


def test_detects_tf_config_and_slurm():
    assert cluster.detect({}) is None
    assert cluster.detect({"TF_CONFIG": "{}"}) is None
    assert cluster.detect({"TF_CONFIG": json.dumps(GOOD)}) == "TF_CONFIG"
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NODELIST": "n[1-2]",
    }
    assert cluster.detect(slurm) == "Slurm"
    assert cluster.detect({**slurm, "SLURM_NTASKS": "1"}) is None
    assert cluster.detect({"PMI_RANK": "0", "PMI_SIZE": "2"}) == "MPI"
    # TF_CONFIG wins over a launcher's variables.
    tf_config = {"TF_CONFIG": json.dumps(GOOD)}
    assert cluster.detect({**slurm, **tf_config}) == "TF_CONFIG"


def test_auto_chooses_multi_worker_under_a_cluster(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(GOOD))
    assert auto.choose().backend == "MultiWorkerReplicator"
    monkeypatch.delenv("TF_CONFIG")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert auto.choose().backend == "LocalReplicator"


def test_auto_without_a_cluster_picks_one_process_with_every_cpu_replica(
    monkeypatch,
):
    for name in ("TF_CONFIG", "SLURM_JOB_ID", "TPU_NAME", "COLAB_TPU_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("KERAS_REPLICATOR_CPU_REPLICAS", raising=False)
    monkeypatch.setattr(auto.devices_lib.os, "cpu_count", lambda: 16)
    choice = auto.choose()
    # A 16-core host: one process with 8 replicas (the logical-CPU cap).
    assert (choice.backend, choice.kwargs) == (
        "LocalReplicator",
        {"num_replicas": 8},
    )
    assert "one process with every replica" in choice.reason
    assert "1.34x" in choice.reason
    monkeypatch.setenv("KERAS_REPLICATOR_CPU_REPLICAS", "3")
    assert auto.choose().kwargs == {"num_replicas": 3}


def test_tf_config_command_prints_a_valid_config(capsys):
    assert (
        cli.main(["tf-config", "--hosts", "h1:22,h2:22", "--index", "1"]) == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed == {
        "cluster": {"worker": ["h1:22", "h2:22"]},
        "task": {"type": "worker", "index": 1},
    }


def test_tf_config_command_rejects_bad_index(capsys):
    code = cli.main(["tf-config", "--hosts", "h1:22", "--index", "3"])
    assert code == 2
    assert "task.index=3" in capsys.readouterr().err
