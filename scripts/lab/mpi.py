"""The two MPI families users launch with, from Debian's packages: OpenMPI (``openmpi-bin``:
``mpirun --allow-run-as-root --oversubscribe -np N ...``) and MPICH (``mpich``: the Hydra process
manager, ``mpiexec -n N ...``, whose variables Intel MPI's Hydra sets too)."""

from __future__ import annotations

from .procs import install

KINDS = ("openmpi", "mpich")
PACKAGES = {"openmpi": ("openmpi-bin",), "mpich": ("mpich",)}
LAUNCHERS = {"openmpi": "mpirun.openmpi", "mpich": "mpiexec.mpich"}
"""Each family's own launcher by name: with both installed, plain ``mpirun`` is whichever Debian's
alternatives chose."""


def up(kind: str = "openmpi") -> float:
    """Install ``kind`` once; seconds the install took (0 when it was there)."""
    return install(PACKAGES[kind], LAUNCHERS[kind])


def mpirun(np: int, kind: str = "openmpi") -> list[str]:
    """The launcher prefix of ``kind`` for ``np`` processes on this machine (as root, more ranks than cores)."""
    if kind == "openmpi":
        return [LAUNCHERS[kind], "--allow-run-as-root", "--oversubscribe", "-np", str(np)]
    return [LAUNCHERS[kind], "-n", str(np)]
