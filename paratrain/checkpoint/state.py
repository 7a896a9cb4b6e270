"""What a paratrain checkpoint holds, and how a run is restored from it exactly.

A checkpoint is taken at an optimizer-step boundary and holds: the model and optimizer state,
the loss scaler and skipped-step count, the LR scheduler, the global step (which *is* the
sampler position, mid-epoch included), the global batch and seed, every rank's RNG states and
the caller's ``extra`` (e.g. the config). Because the data order depends only on (seed, step),
a checkpoint written at world size 4 resumes at 1 or 2 with the same global batches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .io import CheckpointError, list_checkpoints, load_file, load_latest, verify_checkpoint, write_checkpoint
from .rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from ..parallel import Parallel

__all__ = ["save_checkpoint", "load_checkpoint", "uncompiled_keys"]

FORMAT = 1


def _distributed(pt: "Parallel") -> bool:
    return pt.dist.backend is not None and pt.world_size > 1


def _gather_rng(pt: "Parallel") -> list[Any]:
    mine = rng_state()
    if not _distributed(pt):
        return [mine]
    out: list[Any] = [None] * pt.world_size if pt.is_main_process else []
    dist.gather_object(mine, out if pt.is_main_process else None, dst=0)
    return out


def save_checkpoint(pt: "Parallel", directory: str | os.PathLike, model: torch.nn.Module, optimizer: Any,
                    scheduler: Any = None, extra: dict[str, Any] | None = None, keep: int = 3) -> Path | None:
    """Write a checkpoint of the current step (collective: call it on every rank)."""
    if pt.micro_step:
        raise RuntimeError(f"checkpoint asked for in the middle of an accumulation (micro-step {pt.micro_step}): "
                           "save after optimizer.step()")
    optimizer = getattr(optimizer, "optimizer", optimizer)
    rngs = _gather_rng(pt)  # every rank takes part
    sharded, digests = None, {}
    if pt.strategy.sharded_state:  # every rank writes its own shards; the .pt file (then the manifest) points at them
        from .sharded import save_sharded

        sharded = f"step-{pt.global_step:08d}.dcp"
        digests = {f"{sharded}/{name}": d for name, d in save_sharded(Path(directory) / sharded, model,
                                                                      optimizer).items()}
    if not pt.is_main_process:
        return None
    model_state, optim_state = (None, None) if sharded else pt.strategy.checkpoint_state(pt.unwrap(model), optimizer)
    state = {
        "format": FORMAT,
        "global_step": pt.global_step,
        "global_batch": pt.plan.global_batch,
        "seed": pt.config.seed,
        "world_size": pt.world_size,
        "sharded": sharded,
        "model": model_state,
        "optimizer": optim_state,
        "precision": pt.precision.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rngs,
        "extra": extra or {},
    }
    return write_checkpoint(directory, pt.global_step, state, keep=keep, digests=digests)


def _pick(source: str | os.PathLike) -> str | None:
    """The checkpoint file to load: ``source`` itself once verified, or a directory's newest good one."""
    src = Path(source)
    if src.is_dir():
        found = load_latest(src)
        return str(found[0]) if found else None
    verify_checkpoint(src)
    return str(src)


def _choose(pt: "Parallel", source: str | os.PathLike) -> str | None:
    """Rank 0 picks and verifies the checkpoint file; all ranks agree, on an error too."""
    choice: list[Any] = [None]
    failure = None
    if pt.is_main_process:
        try:
            choice[0] = ("ok", _pick(source))
        except Exception as e:  # the other ranks wait in the broadcast: tell them before raising
            failure, choice[0] = e, ("error", str(e) if isinstance(e, CheckpointError) else
                                     f"rank 0 could not choose a checkpoint in {str(source)!r}: {type(e).__name__}")
    if _distributed(pt):
        dist.broadcast_object_list(choice, src=0)
    if failure is not None:
        raise failure
    kind, value = choice[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def load_checkpoint(pt: "Parallel", source: str | os.PathLike, model: torch.nn.Module, optimizer: Any = None,
                    scheduler: Any = None) -> dict[str, Any] | None:
    """Restore everything from ``source`` (a checkpoint file, or a directory: its newest good
    checkpoint). Returns the checkpoint's ``extra``, or ``None`` when a directory holds none.
    Raises :class:`CheckpointError` when ``source`` fails verification, or none of a directory's
    checkpoints is good."""
    path = _choose(pt, source)
    if path is None:
        return None
    state = load_file(path)
    if state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r} has format {state.get('format')!r}, expected {FORMAT}")
    if state["global_batch"] != pt.plan.global_batch:
        raise ValueError(f"checkpoint {path!r} was written with global batch {state['global_batch']}, this run uses "
                         f"{pt.plan.global_batch}: resume with the same global batch (the world size may change)")
    if state.get("sharded"):  # DCP reshards to this run's world size and strategy
        from .sharded import load_sharded

        load_sharded(Path(path).parent / state["sharded"], model, optimizer)
    elif pt.strategy.sharded_state:
        raise CheckpointError(f"checkpoint {path!r} holds a full (unsharded) model; load it into a ddp/single run, "
                              "or save it again from a sharded one")
    else:
        pt.strategy.load_checkpoint_state(pt.unwrap(model), getattr(optimizer, "optimizer", optimizer),
                                          uncompiled_keys(state["model"]), state["optimizer"])
    pt.precision.load_state_dict(state["precision"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    pt.global_step, pt.micro_step = int(state["global_step"]), 0
    rngs = state["rng"]
    if pt.rank < len(rngs):
        set_rng_state(rngs[pt.rank])
    else:  # a rank that did not exist when the checkpoint was written
        torch.manual_seed(pt.config.seed * 1_000_003 + pt.global_step * 1_009 + pt.rank)
    return state["extra"]


def uncompiled_keys(model_state: dict[str, Any]) -> dict[str, Any]:
    """``model_state`` with ``torch.compile``'s ``_orig_mod.`` prefix removed from every key, so a
    state dict saved from a compiled model (by torch, or by an older paratrain) loads into the
    plain module that paratrain saves and loads."""
    marker = "_orig_mod."
    if not any(marker in k for k in model_state):
        return model_state
    return {".".join(p for p in k.split(".") if p != "_orig_mod"): v for k, v in model_state.items()}


def has_checkpoint(directory: str | os.PathLike) -> bool:
    return bool(list_checkpoints(directory))
