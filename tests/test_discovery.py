"""Cluster discovery from Slurm and MPI environments (recorded variables)."""

import pytest

from keras_replicator._src.cluster import discovery

# Recorded from `srun -N1 -n4 env` (one node, four tasks); task 2 shown.
SLURM_1_NODE_4_TASKS = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "2",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "0",
    "SLURM_STEP_NODELIST": "gpu17",
    "SLURM_STEP_TASKS_PER_NODE": "4",
    "SLURM_JOB_NODELIST": "gpu17",
    "SLURM_TASKS_PER_NODE": "4",
}

# Recorded from `srun -N3 -n7 env` on node[01-02,07]; task 5 shown.
SLURM_3_NODES = {
    "SLURM_JOB_ID": "1001",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "7",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_STEP_NODELIST": "node[01-02,07]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),3",
    "SLURM_JOB_NODELIST": "node[01-02,07]",
}


def test_slurm_one_node_four_tasks():
    found = discovery.detect(SLURM_1_NODE_4_TASKS)
    base = discovery.SLURM_PORT_BASE + 242 * discovery.SLURM_PORTS_PER_JOB
    assert found.launcher == "slurm"
    assert (found.rank, found.size) == (2, 4)
    assert (found.local_rank, found.local_size) == (2, 4)
    assert found.tf_config() == {
        "cluster": {"worker": [f"gpu17:{base + i}" for i in range(4)]},
        "task": {"type": "worker", "index": 2},
    }


def test_slurm_three_nodes_with_bracketed_node_list():
    found = discovery.detect(SLURM_3_NODES)
    base = discovery.SLURM_PORT_BASE + 1 * discovery.SLURM_PORTS_PER_JOB
    assert found.tf_config() == {
        "cluster": {
            "worker": [
                f"node01:{base}",
                f"node01:{base + 1}",
                f"node02:{base}",
                f"node02:{base + 1}",
                f"node07:{base}",
                f"node07:{base + 1}",
                f"node07:{base + 2}",
            ]
        },
        "task": {"type": "worker", "index": 5},
    }
    assert (found.local_rank, found.local_size) == (1, 3)


def test_slurm_port_override_and_default_task_layout():
    env = dict(SLURM_3_NODES, KERAS_REPLICATOR_PORT="31000")
    del env["SLURM_STEP_TASKS_PER_NODE"]
    # 7 tasks on 3 nodes, block layout 3, 2, 2: task 5 is node07 local 0.
    env["SLURM_LOCALID"] = "0"
    found = discovery.detect(env)
    assert found.workers[:4] == (
        "node01:31000",
        "node01:31001",
        "node01:31002",
        "node02:31000",
    )


@pytest.mark.parametrize(
    "nodelist, expected",
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a1,b[8-10]", ["a1", "b8", "b9", "b10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("single", ["single"]),
        ("n[009-011]x", ["n009x", "n010x", "n011x"]),
    ],
)
def test_expand_nodelist(nodelist, expected):
    assert discovery.expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["node[01-03", "node[3-1]", "node[a-b]", ""])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError, match="Received: "):
        discovery.expand_nodelist(bad)


def test_expand_tasks_per_node():
    assert discovery.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="Received: '2x3'"):
        discovery.expand_tasks_per_node("2x3")


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"PMI_RANK": "2", "PMI_SIZE": "2"},
            "Received: PMI_RANK=2, PMI_SIZE=2",
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "4"},
            "Received: OMPI_COMM_WORLD_RANK=5, OMPI_COMM_WORLD_SIZE=4",
        ),
        (
            dict(SLURM_1_NODE_4_TASKS, SLURM_PROCID="4"),
            "Received: SLURM_PROCID=4, SLURM_NTASKS=4",
        ),
        ({"PMI_RANK": "-1", "PMI_SIZE": "2"}, "Received: PMI_RANK='-1'"),
        (
            dict(SLURM_1_NODE_4_TASKS, SLURM_NTASKS="5"),
            "SLURM_NTASKS=5",
        ),
        (
            dict(SLURM_1_NODE_4_TASKS, SLURM_LOCALID="3"),
            "Received: SLURM_LOCALID=3, SLURM_PROCID=2",
        ),
    ],
)
def test_inconsistent_variables_raise_value_error_naming_them(env, message):
    with pytest.raises(ValueError, match=message):
        discovery.detect(env)


def test_mpi_variables_of_each_implementation():
    mpich = discovery.detect(
        {
            "PMI_RANK": "1",
            "PMI_SIZE": "2",
            "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "2",
        }
    )
    openmpi = discovery.detect(
        {
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "3",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        }
    )
    assert (mpich.launcher, mpich.rank, mpich.size, mpich.local_rank) == (
        "mpi",
        1,
        2,
        1,
    )
    assert (openmpi.rank, openmpi.size, openmpi.local_size) == (0, 3, 1)
    assert mpich.workers is None  # filled in by the mpi4py exchange


def test_no_launcher_or_single_process_is_none():
    assert discovery.detect({}) is None
    assert discovery.detect({"PMI_RANK": "0", "PMI_SIZE": "1"}) is None


def test_env_command_shows_the_slurm_launcher_and_cluster():
    import json
    import os
    import subprocess
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if k != "TF_CONFIG" and not k.startswith(("SLURM_", "PMI_"))
    }
    env.update(SLURM_1_NODE_4_TASKS, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-m", "keras_replicator._src.cli.main", "env"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "launcher: slurm: rank 2 of 4 (local rank 2 of 4)" in result.stdout
    line = next(
        x for x in result.stdout.splitlines() if x.startswith("cluster: ")
    )
    config = json.loads(line[len("cluster: ") :])
    assert config["task"] == {"type": "worker", "index": 2}
    assert len(config["cluster"]["worker"]) == 4
    assert "auto() picks: MultiWorkerReplicator" in result.stdout
