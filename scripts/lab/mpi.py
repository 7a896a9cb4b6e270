"""OpenMPI from Debian's ``openmpi-bin``: ``mpirun --allow-run-as-root --oversubscribe -np N ...``."""

from __future__ import annotations

from .procs import install

PACKAGES = ("openmpi-bin",)


def up() -> float:
    """Install OpenMPI once; seconds the install took (0 when it was there)."""
    return install(PACKAGES, "mpirun")


def mpirun(np: int) -> list[str]:
    """The ``mpirun`` prefix for ``np`` processes on this machine (as root, more ranks than cores)."""
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np)]
