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
