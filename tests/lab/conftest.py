"""The lab (``scripts/lab``): test hosts in network namespaces, brought up once per session and
always torn down; Slurm and OpenMPI on demand. Skipped, with the reason, where the lab cannot run
(not root, no ``ip netns``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from scripts.lab import hosts  # noqa: E402

HOSTS = 3


@pytest.fixture(scope="session")
def lab():
    """Three hosts ``pt-h0..2`` on a bridge; every process in them is killed at the end."""
    why = hosts.unavailable()
    if why:
        pytest.skip(f"lab: {why}")
    hosts.up(HOSTS)
    try:
        yield hosts
    finally:
        hosts.down()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert hosts.hosts() == [] and f" {hosts.PREFIX}" not in links, "lab down left namespaces or links"


@pytest.fixture
def fresh_lab(lab):
    """The session's lab with every link up and unshaped, and no process left in a host after the test."""
    yield lab
    for ns in lab.hosts():
        for pid in lab.pids(ns):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    for i in range(HOSTS):
        lab.heal(i)
    lab.net()


@pytest.fixture(scope="session")
def lab_slurm():
    """munged, slurmctld and slurmd of the lab (installed once by apt-get); the ``srun``/``sbatch``
    environment. Every daemon and job step is gone after the session."""
    from scripts.lab import procs, slurm

    if os.geteuid() != 0:
        pytest.skip("lab slurm: needs root (apt-get, munged as the munge user)")
    try:
        slurm.up()
        yield slurm
    finally:
        procs.stop_daemons()
    assert procs.lab_daemons() == [], "munged/slurmctld/slurmd/slurmstepd left running"


@pytest.fixture(scope="session")
def lab_mpi():
    """The lab's MPI module: OpenMPI installed (once, by apt-get); a test installs MPICH with ``up("mpich")``."""
    from scripts.lab import mpi

    if os.geteuid() != 0:
        pytest.skip("lab mpi: needs root (apt-get)")
    mpi.up()
    return mpi


@pytest.fixture(scope="session")
def nproc2_run(tmp_path_factory):
    """``paratrain train --nproc-per-node 2`` of :data:`TRAIN_ARGS`: what srun and mpirun must equal."""
    from clitools import run_cli
    from labrun import TRAIN_ARGS

    out = tmp_path_factory.mktemp("nproc2")
    r = run_cli(["train", "--nproc-per-node", "2", *TRAIN_ARGS, "--log-dir", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return out
