"""MPI launchers: OpenMPI's ``mpirun`` (``OMPI_COMM_WORLD_RANK``, ``..._SIZE``, ``..._LOCAL_RANK``)
and the Hydra process manager of MPICH and Intel MPI (``PMI_RANK``, ``PMI_SIZE``,
``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``)."""

from __future__ import annotations

import os

from .base import ProcessInfo, env_int


def detect() -> ProcessInfo | None:
    if "OMPI_COMM_WORLD_RANK" not in os.environ or "OMPI_COMM_WORLD_SIZE" not in os.environ:
        return None
    rank = env_int("OMPI_COMM_WORLD_RANK")
    local_world = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    return ProcessInfo(
        rank=rank,
        world_size=env_int("OMPI_COMM_WORLD_SIZE"),
        local_rank=env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0),
        local_world_size=local_world,
        node_rank=rank // max(1, local_world),
        # mpirun does not choose a rendezvous address: the user exports MASTER_ADDR (rank 0's host).
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=env_int("MASTER_PORT", 29500),
        source="mpi",
    )


def detect_hydra() -> ProcessInfo | None:
    """MPICH's and Intel MPI's ``mpiexec`` (Hydra): ``PMI_RANK``/``PMI_SIZE``, local rank from
    ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``."""
    if "PMI_RANK" not in os.environ or "PMI_SIZE" not in os.environ:
        return None
    rank = env_int("PMI_RANK")
    local_world = env_int("MPI_LOCALNRANKS", 1)
    return ProcessInfo(
        rank=rank,
        world_size=env_int("PMI_SIZE"),
        local_rank=env_int("MPI_LOCALRANKID", 0),
        local_world_size=local_world,
        node_rank=rank // max(1, local_world),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=env_int("MASTER_PORT", 29500),
        source="mpi",
    )
