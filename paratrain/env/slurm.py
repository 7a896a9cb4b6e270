"""Slurm: one task per process, started by ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``...)."""

from __future__ import annotations

import os
import re

from .base import ProcessInfo, env_int


def first_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: ``node[03-05,7]`` -> ``node03``; ``a,b`` -> ``a``;
    ``nid[00001-00004]-hsn`` -> ``nid00001-hsn``; ``rack[1-2]-node[01-04]`` -> ``rack1-node01``."""
    m = re.match(r"(?:[^,\[]+|\[[^\]]*\])+", nodelist.strip())
    if not m:
        return "127.0.0.1"
    # every bracketed range of the first name gives its first value
    return re.sub(r"\[([^\]\-,]*)[^\]]*\]", r"\1", m.group(0))


def tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"SLURM_TASKS_PER_NODE={spec!r} is not Slurm's N(xK),M form")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _first(*names: str) -> str | None:
    """The first of ``names`` that is set."""
    return next((n for n in names if n in os.environ), None)


def detect() -> ProcessInfo | None:
    # Only a task of a job step (srun) is a worker. An interactive allocation (salloc) has no
    # SLURM_PROCID; an sbatch script has SLURM_PROCID=0 and the job's SLURM_NTASKS but no step id:
    # it is the one process that starts the job, not rank 0 of it.
    # The step's variables first: a step of fewer tasks or nodes than the job (srun -n 2 in an
    # 8-task job, srun -r1) has its own; srun --export/-E can leave the job's in SLURM_NTASKS.
    ntasks = _first("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if "SLURM_PROCID" not in os.environ or ntasks is None:
        return None
    step = _first("SLURM_STEP_ID", "SLURM_STEPID")
    if step is None:
        return None
    world = env_int(ntasks)
    nnodes = env_int(_first("SLURM_STEP_NUM_NODES", "SLURM_NNODES") or "SLURM_NNODES", 1)
    node = env_int("SLURM_NODEID", 0)
    per_node = _first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    layout = tasks_per_node(os.environ[per_node]) if per_node else []
    # Uneven layouts ("2(x3),1") give each node its own count; without one, the tasks spread evenly.
    local_world = layout[node] if node < len(layout) else world // max(1, nnodes)
    nodelist = _first("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    addr = os.environ.get("MASTER_ADDR") or (first_host(os.environ[nodelist]) if nodelist else "127.0.0.1")
    # A port per job and step, so that two jobs on one node, or two steps of a job, do not collide.
    step_id = int(os.environ[step]) if os.environ[step].isdigit() else 0
    port = env_int("MASTER_PORT", 15000 + (env_int("SLURM_JOB_ID", 0) + 7919 * step_id) % 20000)
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
