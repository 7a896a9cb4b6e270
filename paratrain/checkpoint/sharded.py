"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), for fsdp, tensor and pipeline.

Every rank writes only its own shards, in parallel; nothing is gathered on one process. DCP
records the global shape of every tensor, so a checkpoint saved on N processes loads on M (or
on one process into a plain model): each rank reads the pieces its new shards need. The state
dicts come from ``torch.distributed.checkpoint.state_dict``, which names parameters and
optimizer state by the user's fully qualified names whatever the sharding; the optimizer state is
flattened (``state.<name>.<key>``, ``param_groups.<name>.<key>``), so ranks holding different
parameters (pipeline stages) never write or read each other's entries. Layout::

    path/            # written as path.tmp, renamed when every rank has finished
        .metadata    # DCP's index of global shapes and shard locations
        __0_0.distcp # rank 0's shards, __1_0.distcp rank 1's...
        extra.json   # the caller's small plain data (step...), written by rank 0

``path`` must be on a filesystem every rank sees. Loading never runs pickled code: ``.metadata``
and non-tensor entries are read by the restricted loaders of :mod:`.safe_dcp`.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import CheckpointError
from .manifest import file_digest, fsync_dir

__all__ = ["save_sharded", "start_sharded", "commit_sharded", "folder_digests", "load_sharded", "load_full",
           "optimizer_names", "full_state_dict"]

EXTRA = "extra.json"


def _plain(model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
    """The module and optimizer this rank holds. What ``paratrain.Parallel.setup`` returned says
    it itself (``checkpointed_module()``, ``.optimizer``): asked for, not imported, so that
    checkpointing stays a leaf below the strategies."""
    held = getattr(model, "checkpointed_module", None)
    if callable(held):
        model = held()
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    return model, optimizer


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _nonempty_groups(optimizer: Any) -> Any:
    """``optimizer`` itself, or a view of it without its empty param groups.

    A pipeline stage keeps the user's groups but only its own parameters, so a group can be empty
    there; torch's state-dict helpers fail to load into an empty group (torch 2.13). The view
    shares the optimizer's state and group dicts; :func:`_merge_view` brings back what loading
    replaced on the view."""
    if optimizer is None or all(g["params"] for g in optimizer.param_groups):
        return optimizer
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.param_groups = [g for g in optimizer.param_groups if g["params"]]
    return view


def _merge_view(optimizer: Any, view: Any) -> None:
    """After ``view.load_state_dict``: the loaded state and hyperparameters into ``optimizer``."""
    if view is optimizer or optimizer is None:
        return
    optimizer.state = view.state
    for group, loaded in zip([g for g in optimizer.param_groups if g["params"]], view.param_groups):
        group.update({k: v for k, v in loaded.items() if k != "params"})


def _state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model, options=_options())}
    model_state, optim_state = get_state_dict(model, optimizer, options=_options())
    return {"model": model_state, "optim": optim_state}


def _files(path: str | os.PathLike) -> list[str]:
    path = os.fspath(path)
    return sorted(os.path.relpath(os.path.join(root, name), path) for root, _, names in os.walk(path) for name in names)


def _digests(path: str) -> dict[str, str]:
    """SHA-256 of every file under ``path``, hashed by all ranks in parallel (each a share of the
    files); the whole map on rank 0, ``{}`` elsewhere."""
    files = _files(path)
    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    mine = {f: file_digest(os.path.join(path, f)) for f in files[rank::world]}
    if world == 1:
        return mine
    parts: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, parts if rank == 0 else None, dst=0)
    return {f: d for part in parts for f, d in part.items()} if rank == 0 else {}


def _begin(path: str) -> str:
    """Clear a crashed save's ``path.tmp`` (rank 0), with every rank waiting for it; the folder to write."""
    tmp = f"{path}.tmp"
    if not _distributed() or dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crashed save
    if _distributed():
        dist.barrier()
    return tmp


def commit_sharded(path: str | os.PathLike, extra: dict[str, Any] | None = None) -> None:
    """Rank 0, once every rank's shards are in ``path.tmp``: add ``extra.json`` and rename it to ``path``."""
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    with open(os.path.join(tmp, EXTRA), "w") as f:
        json.dump(extra or {}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)  # DCP's writer syncs its files; their names and extra.json's are the folder's
    old = f"{path}.old"
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))  # the rename is on disk before a manifest names it
    shutil.rmtree(old, ignore_errors=True)


def save_sharded(path: str | os.PathLike, model: nn.Module, optimizer: Any = None,
                 extra: dict[str, Any] | None = None) -> dict[str, str]:
    """Write ``model`` (and ``optimizer``) state as a DCP checkpoint directory. Call on all ranks.

    ``extra`` is small JSON-serializable data (step, config...). The directory appears complete or
    not at all: it is written as ``path.tmp`` and renamed once every rank has finished. Returns,
    on rank 0, the SHA-256 digest of every file written (names relative to ``path``) for a
    manifest; ``{}`` on the other ranks.
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    model, optimizer = _plain(model, optimizer)
    json.dumps(extra or {})  # on every rank: fail before any collective if extra is not plain data
    main = not _distributed() or dist.get_rank() == 0
    try:
        dcp.save(_state(model, _nonempty_groups(optimizer)), checkpoint_id=_begin(path))  # every rank fails alike
        if main:
            commit_sharded(path, extra)
    except BaseException:  # a full disk...: the shards written so far take no room from the next try
        if main:
            shutil.rmtree(f"{path}.tmp", ignore_errors=True)
        raise
    if _distributed():
        dist.barrier()  # nobody reads path before it is complete
    return _digests(path)


def start_sharded(path: str | os.PathLike, model: nn.Module, optimizer: Any, group: Any) -> Any:
    """:func:`save_sharded`'s writing in the background: DCP's ``async_save`` copies this rank's
    shards to CPU memory now and writes them into ``path.tmp`` in a thread, coordinating over
    ``group`` (a gloo group of its own, so that it never interleaves with training's
    collectives). Returns its future: on rank 0 it is done once every rank's shards and DCP's
    ``.metadata`` are written; then :func:`commit_sharded` makes ``path``. Call on all ranks."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = _plain(model, optimizer)
    return dcp.async_save(_state(model, _nonempty_groups(optimizer)), checkpoint_id=_begin(os.fspath(path)),
                          process_group=group)


def folder_digests(path: str | os.PathLike) -> dict[str, str]:
    """The SHA-256 digest of every file of a written DCP folder, read by this one process (rank 0
    of an asynchronous save: the folder is on a filesystem every rank sees)."""
    return {f: file_digest(os.path.join(path, f)) for f in _files(path)}


def load_sharded(path: str | os.PathLike, model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """Load a :func:`save_sharded` checkpoint into ``model`` (and ``optimizer``), resharding to this
    run's world size and strategy. Call on all ranks. Returns the saved ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from .safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_metadata  # DCP: seconds to import, when sharded

    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"{path!r} is not a sharded checkpoint (no .metadata): pass a save_sharded directory")
    read_metadata(os.path.join(path, ".metadata"))  # refused in one line here, before DCP reads it
    model, optimizer = _plain(model, optimizer)
    view = _nonempty_groups(optimizer)
    state = _state(model, view)  # shapes and shardings to load into; DCP fills them in place
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(path))
    except CheckpointException as e:  # every rank's traceback: keep the first cause's one line
        cause = next((exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)), None)
        if cause is None:
            raise
        raise CheckpointError(str(cause)) from None
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=_options())
    else:
        set_state_dict(model, view, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_options())
        _merge_view(optimizer, view)
    extra_path = os.path.join(path, EXTRA)
    if not os.path.isfile(extra_path):
        return {}
    with open(extra_path) as f:
        return json.load(f)


def optimizer_names(module: nn.Module, optimizer: Any) -> list[list[str]] | None:
    """The user's name of each parameter of ``optimizer``, group by group (what an unsharded
    checkpoint's optimizer state, numbered by position, needs to load into a sharded run)."""
    if optimizer is None:
        return None
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names.get(id(p), "") for p in group["params"]] for group in optimizer.param_groups]


def load_full(model: nn.Module, optimizer: Any, model_state: dict[str, Any], optim_state: dict[str, Any] | None,
              names: list[list[str]] | None, where: str) -> None:
    """Load an unsharded checkpoint's state (one process's, ddp's: ``model_state`` under the user's
    names, ``optim_state`` numbered by position, ``names`` the user's name of each position) into
    this rank's part of a sharded run (fsdp, tensor, a pipeline stage, a composed layout): each
    rank takes its own stage's entries, and torch cuts its own shards out of the whole tensors.
    Call on all ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    model, optimizer = _plain(model, optimizer)
    keys = set(model.state_dict())
    absent = sorted(keys - set(model_state))
    if absent:
        raise CheckpointError(f"checkpoint {where} has no {absent[0]!r} (and {len(absent) - 1} more of this model's "
                              "entries): it is another model's")
    mine = {k: v for k, v in model_state.items() if k in keys}
    options = StateDictOptions(full_state_dict=True)  # torch 2.13 cannot distribute a flattened optimizer state
    if optimizer is None or optim_state is None:
        set_model_state_dict(model, mine, options=options)
        return
    if names is None:
        raise CheckpointError(f"checkpoint {where} numbers its optimizer state by position without the parameters' "
                              "names (saved by an older paratrain): resume it under ddp or one process, and save it again")
    # The saved state by the user's names; a tied parameter (GPT's lm_head.weight is its embedding) is
    # one entry there, under its first name, and the file keeps its other names on the same storage.
    saved: dict[str, tuple[int, int]] = {}  # name -> (group, position)
    for g, (group, group_names) in enumerate(zip(optim_state["param_groups"], names)):
        for index, name in zip(group["params"], group_names):
            saved[name] = (g, index)
    storage = {model_state[n].untyped_storage().data_ptr(): n for n in saved if isinstance(model_state.get(n), torch.Tensor)}
    for key, value in model_state.items():
        if key not in saved and isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in storage:
            saved[key] = saved[storage[value.untyped_storage().data_ptr()]]
    # ... given as this rank's optimizer holds it: its stage's parameters, each under its first name here
    view = _nonempty_groups(optimizer)
    here: dict[int, list[str]] = {id(param): [name] for name, param in model.named_parameters()}
    state = optim_state.get("state", {})
    by_name: dict[str, Any] = {"state": {}, "param_groups": []}
    for group in view.param_groups:
        fqns = [n for p in group["params"] for n in here.get(id(p), [])]
        unknown = [n for n in fqns if n not in saved]
        if unknown:
            raise CheckpointError(f"checkpoint {where} has no optimizer state for {unknown[0]!r}: it is another "
                                  "model's, or its optimizer was built over other parameters")
        g, _ = saved[fqns[0]]
        by_name["param_groups"].append({**optim_state["param_groups"][g], "params": fqns})
        by_name["state"].update({n: state[saved[n][1]] for n in fqns if saved[n][1] in state})
    set_state_dict(model, view, model_state_dict=mine, optim_state_dict=by_name, options=options)
    _merge_view(optimizer, view)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) model state on every rank, e.g. to compare or export."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model, _ = _plain(model, None)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # type: ignore[return-value]
