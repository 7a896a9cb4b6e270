"""Resuming a run: which checkpoint, whether it belongs to this run, and loading it.

The one owner of "resume" (as torchtitan's ``CheckpointManager``): ``paratrain train``'s job makes
one call, ``pt.resume(...)``, which is :func:`resume` here against the :class:`~.state.Run`
protocol and plain arguments. Rank 0 picks and verifies the checkpoint and reads it once; every
rank reads the one it chose, checks it is this run's (``refuse``) before anything is restored, and
restores it (:func:`~.state.load_checkpoint`). :func:`check_continues` is the run-level check
(global batch, seed) that ``Run.load_state_dict`` makes.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch.distributed as dist
from torch import nn
from torch.distributed import DistError

from .io import CheckpointError, list_checkpoints
from .state import ModuleCheckpointing, Run, load_checkpoint

__all__ = ["resume", "check_continues"]


def resume(directory: str | None, run: Run, module: nn.Module, optimizer: Any, how: ModuleCheckpointing,
           scheduler: Any = None, *, asked: bool = True, restarted: bool = False,
           refuse: Callable[[dict[str, Any]], str | None] | None = None) -> dict[str, Any] | None:
    """Continue ``run`` from the newest good checkpoint in ``directory`` when ``asked`` (``--resume``)
    or ``restarted`` (torchrun restarted the workers); returns the checkpoint's ``extra``, or None
    when the run starts at step 0. ``module``, ``optimizer``, ``how``, ``scheduler`` are what
    :func:`~.state.load_checkpoint` restores; ``refuse(extra)`` says why a checkpoint belongs to
    another run (another model...), or None.

    Checkpoints that are all bad are an error (:class:`CheckpointError`), never a silent start from
    scratch. No checkpoint at all is an error when asked; after a restart it means the group failed
    before its first checkpoint, and training starts over from step 0. A fresh run (neither) refuses
    a folder that holds another run's checkpoints: a restart would resume them, and pruning keeps them."""
    if directory is None:
        return None
    if not (asked or restarted):
        held = list_checkpoints(directory) if run.rank == 0 else []
        if _rank0_says(run, bool(held)):
            raise CheckpointError(f"checkpoint_dir {directory!r} already holds another run's checkpoints "
                                  f"({held[-1].name if held else 'rank 0 sees them'}): continue that run with --resume, "
                                  "or choose another --checkpoint-dir")
        return None
    extra = None
    if os.path.isdir(directory):
        try:
            extra = load_checkpoint(directory, run, module, optimizer, how, scheduler, refuse)
        except (CheckpointError, DistError, ValueError):  # a ValueError already says what differs (the global batch)
            raise
        except (RuntimeError, KeyError, TypeError, IndexError) as e:  # state that does not fit this model
            raise CheckpointError(f"--resume: the checkpoint in {directory!r} does not fit this run's model or "
                                  f"optimizer ({' '.join(str(e).split())[:300]})") from e
    if extra is None:
        if not restarted:
            raise CheckpointError(f"--resume: no checkpoint in {directory!r}; run without --resume to start from step 0")
        if run.rank == 0:
            print(f"paratrain: no checkpoint in {directory} yet, starting from step 0")
        return None
    return extra


def _rank0_says(run: Run, flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a collective): what only rank 0 read decides for all."""
    said = [flag]
    if run.world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(said, src=0)
    return bool(said[0])


def check_continues(state: dict[str, Any], global_batch: int, seed: int) -> None:
    """Refuse, in one line, a run ``state`` (``Run.state_dict()`` of a checkpoint) that a run with
    ``global_batch`` and ``seed`` cannot continue: the data position is a step of global batches
    in the epoch order of the seed. The world size may differ."""
    if state["global_batch"] != global_batch:
        raise ValueError(f"was written with global batch {state['global_batch']}, this run uses "
                         f"{global_batch}: resume with the same global batch (the world size may change)")
    if state.get("seed") is not None and int(state["seed"]) != seed:  # the epoch's order is the seed's
        raise ValueError(f"was written with seed {state['seed']}, this run uses {seed}: resume with "
                         "the same seed (the rest of the epoch would repeat some samples and skip others)")
