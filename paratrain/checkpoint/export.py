"""Model-only weights that load anywhere: safetensors plus a small JSON of how they were trained.

:func:`export_checkpoint` turns a training checkpoint of any strategy (a plain ``.pt`` file, or
one whose model lives in a sharded DCP folder) into ``model.safetensors`` with the user's own keys,
unsharded, and ``paratrain.json`` beside it. The checkpoint is verified first (its SHA-256
manifest, the restricted DCP readers): exporting never runs pickled code either.
:func:`save_model` writes a state dict the same way; :func:`load_model` reads it back.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..env.process import barrier
from .errors import CheckpointError
from .io import load_file, load_latest, verify_checkpoint
from .manifest import fsync_dir
from .state import uncompiled_keys

__all__ = ["save_model", "load_model", "export_checkpoint", "save_pretrained", "WEIGHTS", "INFO"]

WEIGHTS = "model.safetensors"
INFO = "paratrain.json"


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError("exporting weights needs safetensors: pip install safetensors "
                         "(or pip install 'paratrain[export]')") from None
    return safetensors.torch


def save_model(state_dict: dict[str, torch.Tensor], directory: str | os.PathLike,
               info: dict[str, Any] | None = None) -> Path:
    """Write ``state_dict`` (plain tensors) as ``directory/model.safetensors`` and ``info`` as
    ``directory/paratrain.json``; returns the weights' path. Tensors that share memory are
    written once each (safetensors refuses aliases), contiguous and on the CPU."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"export folder {str(out)!r} is a file: give a folder")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()
               if isinstance(v, torch.Tensor)}
    meta = {"format": "pt", "producer": "paratrain"}
    path = out / WEIGHTS
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        _safetensors().save_file(tensors, str(tmp), metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except BaseException:  # a full disk, an interrupt: no half file left beside the export
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    info_tmp = out / f"{INFO}.tmp-{os.getpid()}"
    info_tmp.write_text(json.dumps(info or {}, indent=2, default=str) + "\n")
    os.replace(info_tmp, out / INFO)
    fsync_dir(out)
    return path


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The state dict of an exported model (``path``: the folder or its ``model.safetensors``);
    ``model.load_state_dict(load_model(path))`` restores it into the user's plain module."""
    p = Path(path)
    if p.is_dir():
        p = p / WEIGHTS
    if not p.is_file():
        raise FileNotFoundError(f"no exported model at {str(path)!r}: expected a folder holding {WEIGHTS}")
    try:
        return _safetensors().load_file(str(p), device=str(device))
    except ValueError:
        raise
    except Exception as e:  # safetensors' own error types for a damaged file
        raise CheckpointError(f"{str(p)!r} is not a readable safetensors file: {type(e).__name__}: {e}") from None


def _sharded_model(folder: Path) -> dict[str, torch.Tensor]:
    """The model entries of a DCP checkpoint folder as full tensors, read in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_metadata

    meta = read_metadata(folder / ".metadata")
    state = {key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
             for key, m in meta.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    if not state:
        raise CheckpointError(f"{str(folder)!r} holds no model tensors")
    dcp.load({"model": state}, storage_reader=SafeFileSystemReader(str(folder)),
             planner=SafeLoadPlanner(str(folder)), no_dist=True)
    return state


def _with_masters(weights: dict[str, Any], masters: list[torch.Tensor] | None, names: list[str] | None) -> dict[str, Any]:
    """A bf16-true/fp16-true run's weights as its fp32 masters, not the rounded low-precision copy
    the model holds (a tied parameter's other names too); the weights as they are otherwise."""
    if not masters or not names or len(names) != len(masters):
        return weights
    out = dict(weights)
    for name, master in zip(uncompiled_keys(dict.fromkeys(names)), masters):
        if name not in weights:
            continue
        held = _where_in_memory(weights[name])
        for key, value in weights.items():  # the names of this very tensor (tied weights)
            if isinstance(value, torch.Tensor) and _where_in_memory(value) == held:
                out[key] = master.to(torch.float32)
    return out


def _where_in_memory(t: torch.Tensor) -> tuple[Any, ...]:
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()


def save_pretrained(module: nn.Module, full_state: Callable[[], dict[str, torch.Tensor]],
                    directory: str | os.PathLike[str], main: bool, **kwargs: Any) -> None:
    """``module.save_pretrained(directory, state_dict=full_state(), **kwargs)`` (a HuggingFace model,
    or anything with that method) written by the ``main`` process, with the whole state gathered on every
    rank (``full_state`` is a collective): what :meth:`paratrain.Parallel.save_pretrained` does."""
    save = getattr(module, "save_pretrained", None)
    if not callable(save):
        raise TypeError(f"save_pretrained: {type(module).__name__} has no save_pretrained method; save "
                        "pt.full_state_dict(model) instead, e.g. with paratrain.save_on_main")
    state = full_state()
    if main:
        save(directory, state_dict=state, **kwargs)
    barrier()


def export_checkpoint(source: str | os.PathLike, directory: str | os.PathLike) -> Path:
    """Export the model of ``source`` (a checkpoint file, a checkpoint folder: its newest good
    checkpoint, or a run folder holding ``checkpoints/``) to ``directory``; returns the weights' path."""
    src = Path(source)
    if src.is_dir() and not any(src.glob("step-*.pt")) and (src / "checkpoints").is_dir():
        src = src / "checkpoints"
    if src.is_dir():
        found = load_latest(src)
        if found is None:
            raise CheckpointError(f"no checkpoint in {str(source)!r}: train with --checkpoint-every N first")
        path, state = found
    else:
        verify_checkpoint(src)
        path, state = src, load_file(src)
    if not isinstance(state, dict) or "global_step" not in state:
        raise CheckpointError(f"{str(path)!r} is not a paratrain training checkpoint")
    if state.get("sharded"):
        weights = _sharded_model(Path(path).parent / state["sharded"])
    else:
        weights = uncompiled_keys(state["model"])
    precision = state.get("precision") or {}
    weights = _with_masters(weights, precision.get("masters"), precision.get("master_names"))
    info = {
        "source": str(Path(path).resolve()),
        "global_step": state["global_step"],
        "global_batch": state.get("global_batch"),
        "seed": state.get("seed"),
        "world_size": state.get("world_size"),
        "sharded": bool(state.get("sharded")),
        "config": (state.get("extra") or {}).get("config"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    return save_model(weights, directory, info)
