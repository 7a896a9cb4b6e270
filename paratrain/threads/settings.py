"""``configure_threads``: a process's intra-op and inter-op threads from its usable cores, the
processes on the machine and the branches meant to run at once."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from ..env.process import is_main_process
from .branches import _reset_pool

__all__ = ["ThreadSettings", "configure_threads", "usable_cores"]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which Slurm and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadSettings:
    """What ``configure_threads`` chose for this process."""

    cores: int
    """Usable cores of the machine (CPU affinity)."""
    local_world_size: int
    """Processes on this machine sharing them."""
    branches: int
    """Branches meant to run at once (fork_map, devices parts)."""
    intra_op: int
    """``torch.set_num_threads``: threads one kernel splits over."""
    inter_op: int
    """``torch.get_num_interop_threads()`` now: forked branches running beside the caller."""
    inter_op_kept: bool
    """Inter-op threads were already fixed (set before, or inter-op work had started): kept as they were."""

    def line(self) -> str:
        kept = " (already fixed in this process: kept)" if self.inter_op_kept else ""
        return (f"paratrain: threads per process: {self.intra_op} intra-op (torch.set_num_threads), {self.inter_op} "
                f"inter-op{kept}; {self.cores} usable cores / {self.local_world_size} local processes, "
                f"{self.branches} concurrent branches")


_printed = False


def configure_threads(local_world_size: int | None = None, *, branches: int = 1,
                      verbose: bool = True) -> ThreadSettings:
    """Set this process's intra-op and inter-op threads from its usable cores and the number of
    processes on the machine, print the choice once (main process) and return it.

    Each process gets ``cores // local_world_size`` cores (at least 1). Intra-op threads are that
    share divided by ``branches`` (``OMP_NUM_THREADS``, when set, wins: the launchers set it per
    worker), and inter-op threads are as many as branches of that width fill the share, so that
    branches × intra-op threads stays within it. ``local_world_size`` defaults to the launcher's
    ``LOCAL_WORLD_SIZE`` (torchrun) or 1. Inter-op threads can be set only once per process, and
    only before inter-op work starts: when that is past, the current value is kept and said.
    Call it at the start of each process, before any model code runs.
    """
    global _printed
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if local_world_size < 1 or branches < 1:
        raise ValueError(f"configure_threads: local_world_size {local_world_size} and branches {branches} "
                         "must be at least 1")
    cores = usable_cores()
    share = max(1, cores // local_world_size)
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    intra = int(omp) if omp.isdigit() and int(omp) > 0 else max(1, share // branches)
    inter = max(1, share // intra)
    torch.set_num_threads(intra)
    kept = False
    if torch.get_num_interop_threads() != inter:
        try:
            torch.set_num_interop_threads(inter)
        except RuntimeError:  # set before, or inter-op work already started: torch allows it once
            kept = True
    _reset_pool()  # threads started from now on read the new intra-op setting
    settings = ThreadSettings(cores=cores, local_world_size=local_world_size, branches=branches, intra_op=intra,
                              inter_op=torch.get_num_interop_threads(), inter_op_kept=kept)
    if verbose and not _printed and is_main_process():
        _printed = True
        print(settings.line(), file=sys.stderr, flush=True)
    return settings
