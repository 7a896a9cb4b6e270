"""Pick the cluster environment this process was started by."""

from __future__ import annotations

from . import mpi, slurm, torchelastic
from .base import ProcessInfo


def detect_process() -> ProcessInfo:
    """Rank, world size and rendezvous address from torchrun, OpenMPI, Slurm or MPICH/Intel MPI;
    else one process.

    torchrun's variables win: torchrun inside a Slurm allocation or under mpirun sets them
    explicitly. OpenMPI's next: ``mpirun`` inside a Slurm allocation starts its daemons with
    ``srun``, so its ranks also carry the daemons' Slurm variables (one task per node). Slurm before
    Hydra's ``PMI_RANK``, which ``srun --mpi=pmi2`` sets too, unless the two disagree: then Hydra's
    ``mpiexec`` started the process through ``srun`` (``-bootstrap slurm``) and Slurm's are its
    proxies'.
    """
    for detect in (torchelastic.detect, mpi.detect):
        info = detect()
        if info is not None:
            return info
    from_slurm, from_hydra = slurm.detect(), mpi.detect_hydra()
    if from_slurm is not None and (from_hydra is None or (from_hydra.rank, from_hydra.world_size)
                                   == (from_slurm.rank, from_slurm.world_size)):
        return from_slurm
    return from_hydra or ProcessInfo()
