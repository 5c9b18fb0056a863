"""The transport's choice rules (cluster/transport.py): a function of the env.

MPI when mpiexec or srun --mpi started the job with one replica per
process and mpi4py imports; gRPC otherwise (TF_CONFIG, launch, Kubernetes)
or when asked; `KERAS_REPLICATOR_TRANSPORT` forces either, and asking for
what cannot run is an error that names the value. The runs under mpiexec
are tests/multi_worker/test_mpi_transport.py's.
"""

import pytest

from keras_replicator._src.cluster import transport

MPIEXEC = {"PMI_RANK": "0", "PMI_SIZE": "2"}
SRUN_MPI = {"PMI_RANK": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
TF_CONFIG = {"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2"]}}'}


@pytest.mark.parametrize(
    "environ, replicas, importable, name, reason",
    [
        (MPIEXEC, 1, True, "mpi", "mpiexec started this job (PMI_RANK is"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, 1, True, "mpi", "OMPI_COMM_WORLD"),
        (SRUN_MPI, 1, True, "mpi", "srun --mpi started this job"),
        (TF_CONFIG, 1, True, "grpc", "no mpiexec or srun --mpi"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, 1, True, "grpc", "no"),
        (MPIEXEC, 1, False, "grpc", "but mpi4py is not installed"),
        (MPIEXEC, 2, True, "grpc", "each process holds 2 replicas"),
        ({**MPIEXEC, transport.ENV: "grpc"}, 1, True, "grpc", "=grpc asks"),
        ({**TF_CONFIG, transport.ENV: " GRPC "}, 1, True, "grpc", "asks"),
        ({**MPIEXEC, transport.ENV: "mpi"}, 1, True, "mpi", "=mpi asks"),
    ],
)
def test_the_transport_follows_the_launcher_unless_forced(
    environ, replicas, importable, name, reason
):
    choice = transport.choose(environ, replicas, importable)
    assert choice.name == name
    assert reason in choice.reason
    assert choice.describe().startswith(f"transport: {name}, as ")


@pytest.mark.parametrize(
    "environ, replicas, importable, error, words",
    [
        ({transport.ENV: "nccl"}, 1, True, ValueError, "Received: "),
        ({transport.ENV: "mpi"}, 1, True, ValueError, "mpiexec or srun --mpi"),
        ({**MPIEXEC, transport.ENV: "mpi"}, 1, False, ImportError, "mpi4py"),
        (
            {**MPIEXEC, transport.ENV: "mpi"},
            4,
            True,
            ValueError,
            "Received: replicas_per_process=4",
        ),
    ],
)
def test_asking_for_what_cannot_run_names_the_value(
    environ, replicas, importable, error, words
):
    with pytest.raises(error, match=transport.ENV) as caught:
        transport.choose(environ, replicas, importable)
    assert words in str(caught.value)


def test_the_default_reads_this_processes_environment(monkeypatch):
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(transport.ENV, raising=False)
    assert transport.choose().name == "grpc"
    monkeypatch.setenv(transport.ENV, "bogus")
    with pytest.raises(ValueError, match="Received: .*'bogus'"):
        transport.choose()
