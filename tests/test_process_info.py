"""`kr.process_index()`, `kr.process_count()`, `kr.is_chief()` in one process.

Alone, under the replicators and `keras.distribution`, and in a process a
launcher described (TF_CONFIG, Slurm's and MPI's variables, read without
connecting). After `keras.distribution.initialize()` over real processes:
tests/multi_worker/test_distribution.py; under `keras-replicator launch`:
tests/multi_worker/test_distribution_gemma.py (the example names its files
by `kr.process_index()`).
"""

import json

import keras
import pytest

import keras_replicator as kr
from keras_replicator._src.cluster import discovery

# Every variable a launcher sets that the three read.
LAUNCHER_VARIABLES = (
    "TF_CONFIG",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    *discovery.MPI_RANK_VARS,
    *discovery._MPI_SIZE_VARS,
)
SLURM_2_OF_4 = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "2",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NODELIST": "gpu17",
    "SLURM_STEP_TASKS_PER_NODE": "4",
}


def _this_process():
    return kr.process_index(), kr.process_count(), kr.is_chief()


@pytest.fixture
def alone(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _tf_config(cluster, task_type, index):
    return json.dumps(
        {"cluster": cluster, "task": {"type": task_type, "index": index}}
    )


def test_a_process_of_its_own_is_process_0_of_1_and_the_chief(alone):
    assert _this_process() == (0, 1, True)


def test_under_a_replicator_and_keras_distribution_one_process_is_alone(
    alone,
):
    with kr.LocalReplicator(num_replicas=2).scope():
        assert _this_process() == (0, 1, True)
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        assert _this_process() == (0, 1, True)
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize(
    "task_type, index, expected",
    [
        ("worker", 0, (0, 2, True)),
        ("worker", 1, (1, 2, False)),
    ],
)
def test_a_launched_worker_reads_its_place_from_tf_config(
    alone, task_type, index, expected
):
    workers = ["localhost:12345", "localhost:12346"]
    alone.setenv("TF_CONFIG", _tf_config({"worker": workers}, task_type, index))
    assert _this_process() == expected


@pytest.mark.parametrize(
    "task_type, index, expected",
    [
        ("chief", 0, (0, 3, True)),
        ("worker", 0, (1, 3, False)),
        ("worker", 1, (2, 3, False)),
    ],
)
def test_a_chief_is_process_0_and_the_workers_follow(
    alone, task_type, index, expected
):
    cluster = {
        "chief": ["localhost:12340"],
        "worker": ["localhost:12341", "localhost:12342"],
    }
    alone.setenv("TF_CONFIG", _tf_config(cluster, task_type, index))
    assert _this_process() == expected


@pytest.mark.parametrize(
    "task_type, chief", [("chief", True), ("worker", False), ("ps", False)]
)
def test_in_a_parameter_server_cluster_only_the_chief_runs_the_program(
    alone, task_type, chief
):
    cluster = {
        "chief": ["localhost:12340"],
        "worker": ["localhost:12341"],
        "ps": ["localhost:12342"],
    }
    alone.setenv("TF_CONFIG", _tf_config(cluster, task_type, 0))
    assert _this_process() == (0, 1, chief)


def test_slurm_and_mpi_ranks_give_the_place(alone):
    for name, value in SLURM_2_OF_4.items():
        alone.setenv(name, value)
    assert _this_process() == (2, 4, False)
    for name in SLURM_2_OF_4:
        alone.delenv(name)
    alone.setenv("OMPI_COMM_WORLD_RANK", "0")
    alone.setenv("OMPI_COMM_WORLD_SIZE", "3")
    assert _this_process() == (0, 3, True)


def test_a_replicator_in_scope_answers_before_the_environment(alone):
    # Two processes were launched, but this one replicates on its own.
    workers = ["localhost:12345", "localhost:12346"]
    alone.setenv("TF_CONFIG", _tf_config({"worker": workers}, "worker", 1))
    with kr.LocalReplicator(num_replicas=2).scope():
        assert _this_process() == (0, 1, True)
    assert _this_process() == (1, 2, False)


def test_a_malformed_tf_config_raises_naming_the_field(alone):
    alone.setenv(
        "TF_CONFIG", _tf_config({"worker": ["localhost:12345"]}, "worker", 3)
    )
    with pytest.raises(ValueError, match="Received: task.index=3"):
        kr.process_index()
