"""Which transport carries the bytes between processes: gRPC or MPI.

The MaTEx paper's "user-transparent" rule: a job that `mpiexec` or
`srun --mpi` started, with mpi4py importable, exchanges its collectives
over MPI with no change to the script; every other multi-process job
(`keras-replicator launch`, Kubernetes' `TF_CONFIG`) keeps TensorFlow's
gRPC collectives. `KERAS_REPLICATOR_TRANSPORT=grpc|mpi` forces either.

MPI carries one replica per process (one rank per device, as Horovod and
MaTEx run): a process that holds several replicas sums them in
TensorFlow's collectives first, which only its gRPC group can do, so a
job with several replicas per process keeps gRPC and says why. Forcing
MPI there is an error.

The choice is a pure function of the environment (and of whether mpi4py
imports), so `keras-replicator env` shows it without starting TensorFlow.
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
    """The transport of this process's collectives between processes.

    Attributes:
        name: `"grpc"` or `"mpi"`.
        reason: Why, in a few words (shown by `env` and a run's first line).
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

    Args:
        environ: The environment to read. Defaults to `os.environ`.
        replicas_per_process: The replicas this process holds (MPI carries
            one).
        mpi_importable: Whether mpi4py imports. Defaults to finding it.

    Returns:
        A `Choice`.

    Raises:
        ValueError: If `KERAS_REPLICATOR_TRANSPORT` is not `grpc` or `mpi`,
            or asks for MPI where it cannot run (no MPI launch, several
            replicas per process), naming the value.
        ImportError: If it asks for MPI and mpi4py is missing.
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
