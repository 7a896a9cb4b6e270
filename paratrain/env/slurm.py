"""Slurm: one task per process, started by ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``...)."""

from __future__ import annotations

import os
import re

from .base import ProcessInfo, env_int


def first_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: ``node[03-05,7]`` -> ``node03``; ``a,b`` -> ``a``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return "127.0.0.1"
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"SLURM_TASKS_PER_NODE={spec!r} is not Slurm's N(xK),M form")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def detect() -> ProcessInfo | None:
    # Only a task of a job step (srun) is a worker. An interactive allocation (salloc) has no
    # SLURM_PROCID; an sbatch script has SLURM_PROCID=0 and the job's SLURM_NTASKS but no step id:
    # it is the one process that starts the job, not rank 0 of it.
    if "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return None
    if "SLURM_STEP_ID" not in os.environ and "SLURM_STEPID" not in os.environ:
        return None
    world = env_int("SLURM_NTASKS")
    nnodes = env_int("SLURM_NNODES", 1)
    node = env_int("SLURM_NODEID", 0)
    layout = tasks_per_node(os.environ["SLURM_TASKS_PER_NODE"]) if "SLURM_TASKS_PER_NODE" in os.environ else []
    # Uneven layouts ("2(x3),1") give each node its own count; without one, the tasks spread evenly.
    local_world = layout[node] if node < len(layout) else world // max(1, nnodes)
    addr = os.environ.get("MASTER_ADDR") or first_host(
        os.environ.get("SLURM_NODELIST", os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1"))
    )
    # A per-job port so that two jobs on one node do not collide.
    port = env_int("MASTER_PORT", 15000 + env_int("SLURM_JOB_ID", 0) % 20000)
    return ProcessInfo(
        rank=env_int("SLURM_PROCID"),
        world_size=world,
        local_rank=env_int("SLURM_LOCALID", 0),
        local_world_size=local_world,
        node_rank=node,
        master_addr=addr,
        master_port=port,
        source="slurm",
    )
