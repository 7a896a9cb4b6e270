"""Pick the cluster environment this process was started by."""

from __future__ import annotations

from . import mpi, slurm, torchelastic
from .base import ProcessInfo

# torchrun's variables win: torchrun inside a Slurm allocation or under mpirun sets them explicitly.
# Slurm before MPI: ``srun --mpi=pmi2`` also sets PMI_RANK.
_ENVIRONMENTS = (torchelastic.detect, slurm.detect, mpi.detect, mpi.detect_hydra)


def detect_process() -> ProcessInfo:
    """Rank, world size and rendezvous address from torchrun, Slurm, OpenMPI or MPICH/Intel MPI;
    else one process."""
    for detect in _ENVIRONMENTS:
        info = detect()
        if info is not None:
            return info
    return ProcessInfo()
