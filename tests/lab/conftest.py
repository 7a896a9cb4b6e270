"""The lab (``scripts/lab``): test hosts in network namespaces, brought up once per session and
always torn down; Slurm and OpenMPI on demand. Skipped, with the reason, where the lab cannot run
(not root, no ``ip netns``)."""

from __future__ import annotations

import os
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


@pytest.fixture(scope="session")
def lab_mpi():
    """OpenMPI (installed once by apt-get)."""
    from scripts.lab import mpi

    if os.geteuid() != 0:
        pytest.skip("lab mpi: needs root (apt-get)")
    mpi.up()
    return mpi


@pytest.fixture(scope="session")
def nproc2_run(tmp_path_factory):
    """``paratrain train --nproc-per-node 2`` of :data:`TRAIN_ARGS`: what srun and mpirun must equal."""
    from clitools import run_cli

    out = tmp_path_factory.mktemp("nproc2")
    r = run_cli(["train", "--nproc-per-node", "2", *TRAIN_ARGS, "--log-dir", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


# The built-in job (mlp on digits), ddp, 40 steps (0.2 s of compute: launching is what costs),
# checkpointed every 10 (the elastic test resumes from one).
STEPS = 40
TRAIN_ARGS = ["--strategy", "ddp", "--max-steps", str(STEPS), "--epochs", "100", "--checkpoint-every", "10",
              "--no-progress"]


def final_state(log_dir: Path, checkpoints: Path | None = None) -> tuple[dict, dict]:
    """The model state of a train run's last checkpoint, and its result.json."""
    import json

    import torch

    ckpt = (checkpoints or log_dir / "checkpoints") / f"step-{STEPS:08d}.pt"
    return torch.load(ckpt, weights_only=True)["model"], json.loads((log_dir / "result.json").read_text())


def assert_same_run(got_dir: Path, want_dir: Path, world_size: int = 2, checkpoints: Path | None = None) -> float:
    """The same final weights (rel 1e-5; rounding gaps measured ~1e-7) and, at the same world size,
    the same final train loss; returns the largest relative error."""
    from parity import assert_same_state

    got, got_result = final_state(got_dir, checkpoints)
    want, want_result = final_state(want_dir)
    assert got_result["world_size"] == world_size and want_result["world_size"] == 2
    if world_size == 2:
        assert got_result["train_loss"] == pytest.approx(want_result["train_loss"], rel=1e-5)
    return assert_same_state(got, want, 1e-5)
