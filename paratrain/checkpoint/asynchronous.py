"""Checkpoints written in the background: ``pt.save_checkpoint(..., asynchronous=True)``, and
``checkpoint_async = true`` for ``paratrain train``.

The save takes what it needs at the step boundary and returns: DCP's ``async_save`` copies each
rank's model and optimizer shards to CPU memory (sharded strategies), rank 0 copies a plain
state, and every rank's RNG state is gathered as in a blocking save. One thread per process then
writes the copy while training goes on. At most one save is in flight: the next save, and
``pt.close()``, first wait for it, and every rank learns there if it failed. The checkpoint
becomes visible exactly as a blocking one does (the DCP folder renamed from ``.tmp``, then the
``.pt`` file and its SHA-256 manifest written atomically by rank 0), so a process killed mid-write
leaves the previous checkpoint the newest good one, and the files, manifests and restricted
readers are the same.
"""

from __future__ import annotations

import copy
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import CheckpointError
from ..env.disk import writing
from .io import intact_note, write_checkpoint
from .sharded import commit_sharded, folder_digests, start_sharded

__all__ = ["save_async", "wait_for_checkpoint", "finish_checkpoints"]

_writer: ThreadPoolExecutor | None = None  # one writing thread per process, made on first use
_pending: Future | None = None  # the save in flight
_group: Any = None  # a gloo group of every rank for DCP's background collectives


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _checkpoint_group() -> Any:
    """A gloo group of its own for DCP's collectives in the writing thread (made once, on every
    rank together: the first asynchronous save is called on all of them)."""
    global _group
    if _group is None and _distributed():
        _group = dist.new_group(backend="gloo")
    return _group


def _snapshot(obj: Any) -> Any:
    """A copy of a state (tensors on the CPU, cloned) that training can no longer change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _snapshot(v)) for k, v in obj.items()) if type(obj) is not dict else \
            {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_snapshot(v) for v in obj)
    return copy.deepcopy(obj)


def wait_for_checkpoint(agree: bool = True) -> None:
    """Wait for this process's save in flight, if any. With ``agree`` (every rank calls it: a save,
    ``close``), a failure on any rank is raised on all, in one line naming the first rank."""
    global _pending
    pending, _pending = _pending, None
    error: BaseException | None = None
    if pending is not None:
        try:
            pending.result()
        except Exception as e:  # raised below on every rank, with the rank that failed
            error = e
    if agree and _distributed():
        failures: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, None if error is None else f"{type(error).__name__}: {error}")
        first = next(((rank, why) for rank, why in enumerate(failures) if why is not None), None)
        if error is None and first is not None:
            raise CheckpointError(f"rank {first[0]} could not write the checkpoint in the background: "
                                  f"{' '.join(first[1].split())[:300]}; the previous checkpoint is intact")
    if error is not None:
        raise error


def finish_checkpoints(wait: bool = True) -> None:
    """Before the process group goes: wait for the save in flight (``wait``, on every rank: a failure
    is raised on all), else leave it (after an error; a killed write leaves the previous checkpoint
    the newest good one), and forget the checkpoint group, which goes with the process group."""
    global _group
    try:
        if wait:
            wait_for_checkpoint()
    finally:
        _group = None


def save_async(directory: str | os.PathLike, step: int, state: dict[str, Any], rank: int, module: nn.Module,
               optimizer: Any, sharded: str | None, keep: int) -> Future:
    """Start writing checkpoint ``step`` (``state``: what :func:`~.state.save_checkpoint` puts in the
    ``.pt`` file, on rank 0; ``sharded``: its DCP folder's name when the module is sharded) and
    return at once; the future's result is the ``.pt`` file's path on rank 0, None elsewhere."""
    global _pending, _writer
    folder = Path(directory) / sharded if sharded else None
    written = start_sharded(folder, module, optimizer, _checkpoint_group()) if folder else None
    snapshot = _snapshot(state) if rank == 0 else None

    def write() -> Path | None:
        if written is not None:
            with writing(folder, after=lambda: intact_note(directory, step), flag="checkpoint folder"):  # type: ignore[arg-type]
                written.result()  # on rank 0: every rank's shards and DCP's .metadata are written
        if rank != 0:
            return None
        digests = {}
        if folder is not None:
            commit_sharded(folder)
            digests = {f"{sharded}/{name}": d for name, d in folder_digests(folder).items()}
        return write_checkpoint(directory, step, snapshot, keep=keep, digests=digests)

    if _writer is None:
        _writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paratrain-checkpoint")
    _pending = _writer.submit(write)
    return _pending
