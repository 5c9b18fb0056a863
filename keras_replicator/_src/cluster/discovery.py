"""Finds the other processes when an HPC launcher started us (MaTEx seed).

A script calling `kr.auto()` runs unmodified under `mpiexec -n 4 python
train.py` or `srun python train.py`: MPI or Slurm only tell each process
who the others are, as a TF_CONFIG-style cluster spec.

- MPI (MPICH / Intel MPI: `PMI_RANK`, `PMI_SIZE`; Open MPI:
  `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`; PMIx: `PMIX_RANK`): each
  rank picks a free port and they exchange `host:port` with one mpi4py
  allgather (the `keras-replicator[mpi]` extra).
- Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_STEP_NODELIST`,
  `SLURM_STEP_TASKS_PER_NODE`, `SLURM_LOCALID`): hosts from the node list,
  ports from a deterministic scheme, no exchange. Wins when both are
  present (srun started an MPI program).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Mapping

from keras_replicator._src.core import env as env_names

# A Slurm task listens on PORT_BASE + (job id % 1000) * 32 + local id (up to
# 32 tasks per node; jobs sharing a node rarely collide);
# KERAS_REPLICATOR_PORT overrides the base.
SLURM_PORT_BASE = 20000
SLURM_PORTS_PER_JOB = 32
PORT_ENV = env_names.PORT
HOST_ENV = env_names.HOST

MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_MPI_LOCAL_RANK_VARS = (
    "MPI_LOCALRANKID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMIX_LOCAL_RANK",
)
_MPI_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


@dataclasses.dataclass(frozen=True)
class Discovered:
    """A cluster found from a launcher's (`"slurm"` or `"mpi"`) environment.

    `rank`/`size` count workers, `local_rank`/`local_size` those on this
    host; `workers` are their `host:port` in rank order (None until the MPI
    `exchange_addresses`).
    """

    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    workers: tuple[str, ...] | None = None

    def tf_config(self) -> dict:
        """The TF_CONFIG dict for this process."""
        if self.workers is None:
            raise RuntimeError(
                "The workers' addresses are not known yet; call "
                "`exchange_addresses` first."
            )
        return {
            "cluster": {"worker": list(self.workers)},
            "task": {"type": "worker", "index": self.rank},
        }

    def describe(self) -> str:
        """One line for `keras-replicator env`."""
        workers = ", ".join(self.workers) if self.workers else "not exchanged"
        return (
            f"{self.launcher}: rank {self.rank} of {self.size} (local rank "
            f"{self.local_rank} of {self.local_size}); workers: {workers}"
        )


def detect(environ: Mapping[str, str] | None = None) -> Discovered | None:
    """Detects a Slurm or MPI launch from `environ` (default `os.environ`).

    Returns None without a launcher or with one process. Raises
    `ValueError`, naming the variables, if they are inconsistent (e.g. a
    rank not below the size).
    """
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        found = _from_slurm(env)
    elif any(v in env for v in MPI_RANK_VARS):
        found = _from_mpi(env)
    else:
        return None
    return found if found.size > 1 else None


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        parsed = int(value)
    except ValueError:
        parsed = -1
    if parsed < 0:
        raise ValueError(
            f"{name} must be a non-negative integer. Received: {name}={value!r}"
        )
    return parsed


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in env), None)


def _check_rank(rank_var, rank, size_var, size):
    if size < 1 or rank >= size:
        raise ValueError(
            f"The rank must be below the size. Received: {rank_var}={rank}, "
            f"{size_var}={size}"
        )


def _from_mpi(env: Mapping[str, str]) -> Discovered:
    rank_var = _first(env, MPI_RANK_VARS)
    rank = _int_var(env, rank_var)
    size_var = _first(env, _MPI_SIZE_VARS)
    if size_var is None:
        # PMIx exports no size variable; mpi4py knows it.
        size_var, size = "MPI.COMM_WORLD.Get_size()", _mpi_comm().Get_size()
    else:
        size = _int_var(env, size_var)
    _check_rank(rank_var, rank, size_var, size)
    local_rank_var = _first(env, _MPI_LOCAL_RANK_VARS)
    local_size_var = _first(env, _MPI_LOCAL_SIZE_VARS)
    local_rank = _int_var(env, local_rank_var) if local_rank_var else 0
    local_size = _int_var(env, local_size_var) if local_size_var else 1
    if local_rank_var and local_size_var:
        _check_rank(local_rank_var, local_rank, local_size_var, local_size)
    return Discovered("mpi", rank, size, local_rank, local_size)


def _from_slurm(env: Mapping[str, str]) -> Discovered:
    rank = _int_var(env, "SLURM_PROCID")
    size = _int_var(env, "SLURM_NTASKS")
    _check_rank("SLURM_PROCID", rank, "SLURM_NTASKS", size)
    nodelist_var = _first(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
    if nodelist_var is None:
        raise ValueError(
            "Slurm sets SLURM_PROCID but neither SLURM_STEP_NODELIST nor "
            "SLURM_JOB_NODELIST. Received: SLURM_PROCID="
            f"{env['SLURM_PROCID']!r}"
        )
    nodes = expand_nodelist(env[nodelist_var])
    tasks_var = _first(
        env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    )
    if tasks_var is None:  # Slurm's block layout: the first nodes get more.
        share, extra = divmod(size, len(nodes))
        per_node = [share + (i < extra) for i in range(len(nodes))]
    else:
        per_node = expand_tasks_per_node(env[tasks_var])
    if len(per_node) != len(nodes) or sum(per_node) != size:
        raise ValueError(
            "The Slurm node list and tasks per node do not add up to the "
            f"number of tasks. Received: {nodelist_var}="
            f"{env[nodelist_var]!r} ({len(nodes)} nodes), {tasks_var}="
            f"{env.get(tasks_var or '', '')!r}, SLURM_NTASKS={size}"
        )
    base = _slurm_port_base(env)
    workers, node_of_rank, local_of_rank = [], [], []
    for node, count in zip(nodes, per_node, strict=True):
        for local in range(count):
            workers.append(f"{node}:{base + local}")
            node_of_rank.append(node)
            local_of_rank.append(local)
    local_rank = local_of_rank[rank]
    if "SLURM_LOCALID" in env:
        declared = _int_var(env, "SLURM_LOCALID")
        if declared != local_rank:
            raise ValueError(
                "SLURM_LOCALID disagrees with the block task layout of the "
                f"node list. Received: SLURM_LOCALID={declared}, "
                f"SLURM_PROCID={rank}, {nodelist_var}={env[nodelist_var]!r}"
            )
    local_size = node_of_rank.count(node_of_rank[rank])
    return Discovered(
        "slurm", rank, size, local_rank, local_size, tuple(workers)
    )


def _slurm_port_base(env: Mapping[str, str]) -> int:
    if PORT_ENV in env:
        return _int_var(env, PORT_ENV)
    job = int(env.get("SLURM_JOB_ID", "0") or 0)
    return SLURM_PORT_BASE + (job % 1000) * SLURM_PORTS_PER_JOB


def expand_nodelist(nodelist: str) -> list[str]:
    """Expands a Slurm node list such as `node[01-03,07],gpu1`, in order.

    Zero padding is kept (`node01`...); several bracket groups in one name
    give every combination. Raises `ValueError`, naming a malformed list.
    """
    if not nodelist or not nodelist.strip():
        raise ValueError(f"Empty Slurm node list. Received: {nodelist!r}")
    names, depth, start = [], 0, 0
    for i, char in enumerate(nodelist + ","):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            names.extend(_expand_name(nodelist[start:i].strip(), nodelist))
            start = i + 1
        if depth not in (0, 1):
            break
    if depth != 0:
        raise ValueError(
            f"Unbalanced brackets in Slurm node list. Received: {nodelist!r}"
        )
    return names


def _expand_name(name: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if not name or "]" in name[: match.start() if match else len(name)]:
        raise ValueError(f"Malformed Slurm node list. Received: {whole!r}")
    if match is None:
        return [name]
    prefix, suffix = name[: match.start()], name[match.end() :]
    expanded = []
    for part in match.group(1).split(","):
        bounds = part.split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            values = [bounds[0]]
        elif len(bounds) == 2 and all(b.isdigit() for b in bounds):
            low, high = int(bounds[0]), int(bounds[1])
            if low > high:
                raise ValueError(
                    f"Descending range {part!r} in Slurm node list. "
                    f"Received: {whole!r}"
                )
            width = len(bounds[0])
            values = [str(v).zfill(width) for v in range(low, high + 1)]
        else:
            raise ValueError(
                f"Bad range {part!r} in Slurm node list. Received: {whole!r}"
            )
        for value in values:
            expanded.extend(_expand_name(prefix + value + suffix, whole))
    return expanded


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expands `SLURM_TASKS_PER_NODE` such as `2(x3),1` to `[2, 2, 2, 1]`."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(
                "Malformed Slurm tasks per node (expected e.g. '2(x3),1'). "
                f"Received: {spec!r}"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _mpi_comm():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(
            "An MPI launch was detected (PMI_RANK / OMPI_COMM_WORLD_RANK / "
            "PMIX_RANK is set) but mpi4py is not installed: pip install "
            "mpi4py (or, in a keras-replicator checkout, pip install "
            "'.[mpi]')"
        ) from e
    return MPI.COMM_WORLD


def exchange_addresses(found: Discovered) -> Discovered:
    """Fills in `found.workers`' `host:port` (MPI: one allgather).

    Each rank picks a free port on its host. All on one host: 127.0.0.1;
    otherwise host names (`KERAS_REPLICATOR_HOST` overrides this one's).
    """
    if found.workers is not None:
        return found
    comm = _mpi_comm()
    host = os.environ.get(HOST_ENV) or socket.gethostname()
    port = free_port()
    hosts_ports = comm.allgather((host, port))
    single_host = len({h for h, _ in hosts_ports}) == 1
    workers = tuple(
        f"{'127.0.0.1' if single_host else h}:{p}" for h, p in hosts_ports
    )
    return dataclasses.replace(found, workers=workers)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
