"""Which transport carries the bytes between processes: gRPC or MPI.

The MaTEx paper's "user-transparent" rule: a job `mpiexec` or `srun --mpi`
started, with mpi4py importable, uses MPI with no script change; others
(`keras-replicator launch`, Kubernetes' `TF_CONFIG`) keep TensorFlow's gRPC.
`KERAS_REPLICATOR_TRANSPORT=grpc|mpi` forces either.

MPI carries one replica per process (one rank per device, as Horovod and
MaTEx): several replicas per process are summed in TensorFlow's
collectives first, which only gRPC can do, so such a job keeps gRPC and
says why (forcing MPI is an error). The choice depends on the environment
(and mpi4py's presence) only, so `keras-replicator env` shows it without
TensorFlow.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping

from keras_replicator._src.cluster import discovery
from keras_replicator._src.core import env as env_names

GRPC = "grpc"
MPI = "mpi"
TRANSPORTS = (GRPC, MPI)
ENV = env_names.TRANSPORT


@dataclasses.dataclass(frozen=True)
class Choice:
    """The transport (`name`: `"grpc"` or `"mpi"`) and the `reason` why.

    `reason` is a few words, shown by `env` and a run's first line.
    """

    name: str
    reason: str

    def describe(self) -> str:
        """One line: `transport: mpi, as mpiexec started this job ...`."""
        return f"transport: {self.name}, as {self.reason}"


def choose(
    environ: Mapping[str, str] | None = None,
    replicas_per_process: int = 1,
    mpi_importable: bool | None = None,
) -> Choice:
    """Chooses gRPC or MPI for this process's collectives between processes.

    `environ` defaults to `os.environ`, `mpi_importable` to finding mpi4py.
    Raises `ValueError` if `KERAS_REPLICATOR_TRANSPORT` is not `grpc` or
    `mpi`, or asks for MPI without an MPI launch or with several replicas
    per process, and `ImportError` if it asks for MPI without mpi4py.
    """
    env = os.environ if environ is None else environ
    if mpi_importable is None:
        mpi_importable = importlib.util.find_spec("mpi4py") is not None
    forced = env.get(ENV, "").strip().lower()
    if forced and forced not in TRANSPORTS:
        raise ValueError(
            f"{ENV} must be one of {', '.join(TRANSPORTS)} (or unset, to "
            f"choose by the launcher). Received: {ENV}={env[ENV]!r}"
        )
    launch = _mpi_launch(env)
    if forced == GRPC:
        return Choice(GRPC, f"{ENV}=grpc asks")
    if forced == MPI:
        if not mpi_importable:
            raise ImportError(
                f"{ENV}=mpi needs mpi4py: pip install 'keras-replicator[mpi]' "
                "(or mpi4py built against your site's MPI)."
            )
        if launch is None:
            raise ValueError(
                f"{ENV}=mpi needs processes that mpiexec or srun --mpi "
                "started (`keras-replicator launch --transport mpi` does). "
                f"Received: {ENV}=mpi with none of "
                f"{', '.join(discovery.MPI_RANK_VARS)} set"
            )
        if replicas_per_process != 1:
            raise ValueError(
                f"{ENV}=mpi carries one replica per process: start one rank "
                "per device (mpiexec -n <devices>), or use gRPC. Received: "
                f"replicas_per_process={replicas_per_process}"
            )
        return Choice(MPI, f"{ENV}=mpi asks")
    if launch is None:
        return Choice(
            GRPC, "no mpiexec or srun --mpi started this job (the default)"
        )
    if not mpi_importable:
        return Choice(GRPC, f"{launch}, but mpi4py is not installed")
    if replicas_per_process != 1:
        return Choice(
            GRPC,
            f"{launch}, but each process holds {replicas_per_process} "
            "replicas and MPI carries one: start one rank per device",
        )
    return Choice(MPI, f"{launch} and mpi4py imports")


def _mpi_launch(env: Mapping[str, str]) -> str | None:
    """Names the MPI launch that started this process, if any."""
    name = next((n for n in discovery.MPI_RANK_VARS if n in env), None)
    if name is None:
        return None
    if "SLURM_PROCID" in env:
        return f"srun --mpi started this job ({name} is set)"
    return f"mpiexec started this job ({name} is set)"
