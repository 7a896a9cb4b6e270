"""What a paratrain checkpoint holds, and how a run is restored from it exactly.

A checkpoint is taken at an optimizer-step boundary and holds: the model and optimizer state,
the loss scaler and skipped-step count, the LR scheduler, the global step (which *is* the
sampler position, mid-epoch included), the global batch and seed, every rank's RNG states and
the caller's ``extra`` (e.g. the config). Because the data order depends only on (seed, step),
a checkpoint written at world size 4 resumes at 1 or 2 with the same global batches.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Protocol

import torch.distributed as dist
from torch import nn

from .io import (CheckpointError, intact_note, list_checkpoints, load_file, load_latest, saved_bytes, verify_checkpoint,
                 write_checkpoint)
from ..env.disk import tensor_bytes, writing
from ..env.seeding import mix_seed, seed_everything
from .rng import rng_state, same_rng_state, set_rng_state
from .asynchronous import save_async, wait_for_checkpoint
from .sharded import load_full, load_sharded, optimizer_names, save_sharded

__all__ = ["Run", "ModuleCheckpointing", "save_checkpoint", "load_checkpoint", "uncompiled_keys", "checkpoint_bytes"]

FORMAT = 1


class Run(Protocol):
    """What a checkpoint restores besides the model (``paratrain.Parallel`` is one): its
    ``state_dict`` holds ``global_step``, ``global_batch``, ``seed``, ``world_size`` and
    ``precision``, like ``torch.distributed.checkpoint.stateful.Stateful``; ``load_state_dict``
    refuses a state it cannot continue (another global batch)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ModuleCheckpointing(Protocol):
    """How a strategy checkpoints the module this rank holds (``paratrain.strategies.Strategy``):
    sharded through DCP (every rank its shards), or as one state rank 0 writes."""

    @property
    def sharded_state(self) -> bool: ...

    def checkpoint_state(self, module: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any] | None]: ...

    def load_checkpoint_state(self, module: nn.Module, optimizer: Any, model_state: dict[str, Any],
                              optim_state: dict[str, Any] | None) -> None: ...


def _distributed(run: Run) -> bool:
    return run.world_size > 1 and dist.is_available() and dist.is_initialized()


def _gather_rng(run: Run) -> list[Any]:
    mine = rng_state()
    if not _distributed(run):
        return [mine]
    out: list[Any] = [None] * run.world_size if run.rank == 0 else []
    dist.gather_object(mine, out if run.rank == 0 else None, dst=0)
    return out


def save_checkpoint(directory: str | os.PathLike, run: Run, module: nn.Module, optimizer: Any,
                    how: ModuleCheckpointing, scheduler: Any = None, extra: dict[str, Any] | None = None,
                    keep: int = 3, asynchronous: bool = False) -> Path | Future | None:
    """Write a checkpoint of ``run``'s current step (collective: call it on every rank).

    ``module`` and ``optimizer`` are the plain ones this rank holds (a pipeline stage, an
    fsdp-sharded module, the user's module), checkpointed the way ``how`` says. Returns the
    ``.pt`` file's path on rank 0 (None elsewhere); ``asynchronous``: a future of it, the state
    copied now and written in the background (:mod:`.asynchronous`)."""
    wait_for_checkpoint()  # the previous background save is complete (or its failure raised on every rank)
    step = run.state_dict()["global_step"]
    rngs = _gather_rng(run)  # every rank takes part
    sharded = f"step-{step:08d}.dcp" if how.sharded_state else None
    model_state, optim_state = (None, None) if sharded or run.rank != 0 else how.checkpoint_state(module, optimizer)
    state = None if run.rank != 0 else {
        "format": FORMAT,
        **run.state_dict(),
        "sharded": sharded,
        "model": model_state,
        "optimizer": optim_state,
        # the user's name of each numbered parameter: a sharded run loads the state by name (load_full)
        "param_names": None if sharded else optimizer_names(module, getattr(optimizer, "optimizer", optimizer)),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rngs,
        "extra": extra or {},
    }
    if asynchronous:
        return save_async(directory, step, state or {}, run.rank, module, optimizer, sharded, keep)
    digests = {}
    if sharded:  # every rank writes its own shards; the .pt file (then the manifest) points at them
        with writing(Path(directory) / sharded, checkpoint_bytes(module, optimizer), after=lambda: intact_note(directory, step),
                     flag="checkpoint folder"):  # a full disk: one line
            shards = save_sharded(Path(directory) / sharded, module, optimizer)
        digests = {f"{sharded}/{name}": d for name, d in shards.items()}
    if state is None:
        return None
    return write_checkpoint(directory, step, state, keep=keep, digests=digests)


def checkpoint_bytes(module: nn.Module, optimizer: Any) -> int:
    """About the bytes a checkpoint of ``module`` and ``optimizer`` takes: the parameters, buffers
    and the optimizer's state (measured once it has some; before its first step one or two tensors
    per parameter, as its momentum or betas say), plus the file's records."""
    inner = getattr(optimizer, "optimizer", optimizer)  # what Parallel.setup returned: the one it wraps
    state = tensor_bytes(list(getattr(inner, "state", {}).values()))
    if not state:
        defaults = getattr(inner, "defaults", {})
        state = (2 if "betas" in defaults else 1 if defaults.get("momentum") else 0) * tensor_bytes(list(module.parameters()))
    return saved_bytes([*module.parameters(), *module.buffers()]) + state


def _pick(source: str | os.PathLike) -> tuple[str | None, Any]:
    """The checkpoint file to load: ``source`` itself once verified, or a directory's newest good
    one, with its state when finding it meant reading it (None: not read yet)."""
    src = Path(source)
    if src.is_dir():
        found = load_latest(src)
        return (str(found[0]), found[1]) if found else (None, None)
    verify_checkpoint(src)
    return str(src), None


def _choose(run: Run, source: str | os.PathLike) -> tuple[str | None, Any]:
    """Rank 0 picks and verifies the checkpoint file; all ranks agree, on an error too. Rank 0 also
    gets the state it read while choosing (so it reads the file once)."""
    choice: list[Any] = [None]
    failure, state = None, None
    if run.rank == 0:
        try:
            path, state = _pick(source)
            choice[0] = ("ok", path)
        except Exception as e:  # the other ranks wait in the broadcast: tell them before raising
            failure, choice[0] = e, ("error", str(e) if isinstance(e, CheckpointError) else
                                     f"rank 0 could not choose a checkpoint in {str(source)!r}: {type(e).__name__}")
    if _distributed(run):
        dist.broadcast_object_list(choice, src=0)
    if failure is not None:
        raise failure
    kind, value = choice[0]
    if kind == "error":
        raise CheckpointError(value)
    return value, state


def load_checkpoint(source: str | os.PathLike, run: Run, module: nn.Module, optimizer: Any,
                    how: ModuleCheckpointing, scheduler: Any = None,
                    refuse: Callable[[dict[str, Any]], str | None] | None = None) -> dict[str, Any] | None:
    """Restore everything from ``source`` (a checkpoint file, or a directory: its newest good
    checkpoint). Returns the checkpoint's ``extra``, or ``None`` when a directory holds none.
    Raises :class:`CheckpointError` when ``source`` fails verification, or none of a directory's
    checkpoints is good, or ``refuse(extra)`` says why the checkpoint is another run's (asked
    before anything is restored). Every rank reads the file, rank 0 once."""
    path, state = _choose(run, source)
    if path is None:
        return None
    failure: BaseException | None = None
    try:  # rank 0 verified the file; every rank reads it (a node that cannot see it fails here)
        if state is None:
            state = load_file(path)
        if not isinstance(state, dict) or "format" not in state:
            failure = CheckpointError(
                f"{path!r} is not a paratrain checkpoint ({type(state).__name__} without a 'format' key): load a "
                "plain state_dict with model.load_state_dict(torch.load(path, weights_only=True))")
        elif state["format"] != FORMAT:
            failure = CheckpointError(f"checkpoint {path!r} has format {state['format']!r}, expected {FORMAT}: "
                                      "written by another paratrain version")
    except Exception as e:
        failure = e
    _agree(run, path, failure)  # no rank goes on to the collectives below while another has failed
    assert state is not None
    why = None if refuse is None else refuse(state.get("extra") or {})
    if why is not None:  # the same answer on every rank: each read the same file
        raise CheckpointError(why)
    try:
        run.load_state_dict({k: state.get(k) for k in ("global_step", "global_batch", "seed", "world_size",
                                                       "precision", "data")})
    except ValueError as e:
        raise ValueError(f"checkpoint {path!r} {e}") from None
    if state.get("sharded"):  # DCP reshards to this run's world size and strategy
        load_sharded(Path(path).parent / state["sharded"], module, optimizer)
    elif how.sharded_state:  # a whole model into this rank's shards or stage: by the parameters' names
        load_full(module, optimizer, uncompiled_keys(state["model"]), state["optimizer"], state.get("param_names"),
                  repr(path))
    else:
        how.load_checkpoint_state(module, optimizer, uncompiled_keys(state["model"]), state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    restore_rng(state["rng"], run)
    return state["extra"]


def _agree(run: Run, path: str, failure: BaseException | None) -> None:
    """Raise on every rank when reading the checkpoint failed on any: this rank's own error, or
    one line naming the first rank that failed."""
    failed = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    if _distributed(run):
        every: list[Any] = [None] * run.world_size
        dist.all_gather_object(every, failed[0])
        failed = every
    if failure is not None:
        raise failure
    first = next(((r, why) for r, why in enumerate(failed) if why is not None), None)
    if first is not None:
        raise CheckpointError(f"rank {first[0]} could not read checkpoint {path!r}: {' '.join(first[1].split())[:300]}")


def restore_rng(rngs: list[Any], run: Run) -> None:
    """This rank's random streams from the checkpoint's (one per rank that wrote it). A rank that
    did not exist then joins the streams when every rank had the same (``Parallel`` seeds them
    alike: tensor parallelism needs one dropout mask on every rank), else gets its own, python's,
    NumPy's and torch's seeded from the run's seed, step and rank."""
    if run.rank < len(rngs):
        set_rng_state(rngs[run.rank])
    elif all(same_rng_state(r, rngs[0]) for r in rngs[1:]):
        set_rng_state(rngs[0])
    else:
        now = run.state_dict()
        seed_everything(mix_seed(now["seed"], now["global_step"], run.rank, bits=63))


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
