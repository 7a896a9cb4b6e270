"""MPI launchers: OpenMPI's ``mpirun`` (``OMPI_COMM_WORLD_RANK``, ``..._SIZE``, ``..._LOCAL_RANK``)
and the Hydra process manager of MPICH and Intel MPI (``PMI_RANK``, ``PMI_SIZE``,
``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``)."""

from __future__ import annotations

import os

from .base import ProcessInfo, env_int


def _from_env(rank: str, size: str, local_rank: str, local_size: str) -> ProcessInfo | None:
    if rank not in os.environ or size not in os.environ:
        return None
    r, world = env_int(rank), env_int(size)
    local_world = env_int(local_size, 1)
    return ProcessInfo(
        rank=r,
        world_size=world,
        local_rank=env_int(local_rank, 0),
        local_world_size=local_world,
        node_rank=r // max(1, local_world),
        # mpirun does not choose a rendezvous address: the user exports MASTER_ADDR (rank 0's host).
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=env_int("MASTER_PORT", 29500),
        source="mpi",
    )


def detect() -> ProcessInfo | None:
    """OpenMPI's ``mpirun``."""
    return _from_env("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                     "OMPI_COMM_WORLD_LOCAL_SIZE")


def detect_hydra() -> ProcessInfo | None:
    """MPICH's and Intel MPI's ``mpiexec`` (Hydra)."""
    return _from_env("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
