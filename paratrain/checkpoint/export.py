"""Model-only weights that load anywhere: safetensors plus a small JSON of how they were trained.

:func:`export_checkpoint` turns a training checkpoint of any strategy (a plain ``.pt`` file, or
one whose model lives in a sharded DCP folder) into ``model.safetensors`` with the user's own keys,
unsharded, and ``paratrain.json`` beside it. A model larger than ``max_shard_size`` is written as
HuggingFace writes one: ``model-00001-of-0000N.safetensors`` files plus
``model.safetensors.index.json`` (``from_pretrained`` loads the folder once it has the model's
``config.json``); from a sharded checkpoint each file's tensors are read from DCP alone, so no more
than one file's worth of the model is ever in memory. The checkpoint is verified first (its SHA-256
manifest, the restricted DCP readers): exporting never runs pickled code either.
:func:`save_model` writes a state dict the same way; :func:`load_model` reads it back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..env.disk import writing
from ..env.process import barrier
from .errors import CheckpointError
from .io import _write_atomic, load_file, load_latest, verify_checkpoint
from .manifest import fsync_dir
from .state import uncompiled_keys

__all__ = ["save_model", "load_model", "load_weights", "export_checkpoint", "save_pretrained", "parse_size", "WEIGHTS", "INDEX",
           "INFO", "MAX_SHARD_SIZE"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"  # HuggingFace's name: {"metadata": {"total_size"}, "weight_map": {key: file}}
INFO = "paratrain.json"
MAX_SHARD_SIZE = "5GB"  # transformers' default for save_pretrained
HF_FILES = ("config.json", "generation_config.json")  # what --hf-config copies beside the weights
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError("exporting weights needs safetensors: pip install safetensors "
                         "(or pip install 'paratrain[export]')") from None
    return safetensors.torch


def parse_size(value: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"1.5GiB"`` or a number of bytes -> bytes (KB/MB/GB are powers of
    1000 and KiB/MiB/GiB of 1024, as in transformers' ``max_shard_size``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"size {value!r} is not a size: give bytes or a number with KB, MB, GB (or KiB, MiB, GiB), "
                         "e.g. 5GB")
    return int(float(match.group(1)) * _UNITS[unit])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _files(sizes: Iterable[tuple[str, int]], limit: int) -> list[list[str]]:
    """Keys in order, cut into files of at most ``limit`` bytes (a larger tensor gets a file alone)."""
    files: list[list[str]] = [[]]
    used = 0
    for key, size in sizes:
        if files[-1] and used + size > limit:
            files.append([])
            used = 0
        files[-1].append(key)
        used += size
    return files


def _write_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    kept = f"the earlier {path.name} there is intact" if path.exists() else "no partial file is left"
    # a full disk, an interrupt: no half file left beside the export, and a full disk is one line
    with writing(path, sum(map(_nbytes, tensors.values())), cleanup=lambda: tmp.unlink(missing_ok=True), after=kept,
                 flag="export folder"):
        _safetensors().save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "paratrain"})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(obj: Any, path: Path) -> None:
    text = json.dumps(obj, indent=2, default=str) + "\n"
    _write_atomic(path, lambda f: f.write(text.encode()), flag="export folder")


def _write_model(directory: str | os.PathLike, files: list[list[str]], sizes: dict[str, int],
                 read: Callable[[list[str]], dict[str, torch.Tensor]], info: dict[str, Any] | None) -> Path:
    """Write ``files`` (key lists, each read with ``read`` when its turn comes and dropped after) as
    ``model.safetensors``, or HuggingFace's numbered files and index when there are several; files of
    an earlier export that the new one does not have are removed. Returns the weights' (or index's) path."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"export folder {str(out)!r} is a file: give a folder")
    out.mkdir(parents=True, exist_ok=True)
    names = [WEIGHTS] if len(files) == 1 else [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                                for i in range(1, len(files) + 1)]
    for name, keys in zip(names, files):
        _write_file(read(keys), out / name)
    kept = set(names)
    if len(files) > 1:
        _write_json({"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {key: name for name, keys in zip(names, files) for key in keys}}, out / INDEX)
        kept.add(INDEX)
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:  # else from_pretrained may read an old single file
        if stale.name not in kept:
            stale.unlink(missing_ok=True)
    _write_json(info or {}, out / INFO)
    fsync_dir(out)
    return out / (INDEX if len(files) > 1 else WEIGHTS)


def save_model(state_dict: dict[str, torch.Tensor], directory: str | os.PathLike,
               info: dict[str, Any] | None = None, max_shard_size: str | int = MAX_SHARD_SIZE) -> Path:
    """Write ``state_dict`` (plain tensors) as ``directory/model.safetensors``, or as HuggingFace's
    numbered files of at most ``max_shard_size`` plus ``model.safetensors.index.json``, and ``info``
    as ``directory/paratrain.json``; returns the weights' (or index's) path. Tensors that share
    memory are written once each (safetensors refuses aliases), contiguous and on the CPU."""
    limit = parse_size(max_shard_size)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()
               if isinstance(v, torch.Tensor)}
    sizes = {k: _nbytes(v) for k, v in tensors.items()}
    return _write_model(directory, _files(sizes.items(), limit), sizes, lambda keys: {k: tensors[k] for k in keys}, info)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The state dict of an exported model (``path``: the folder or its ``model.safetensors``);
    ``model.load_state_dict(load_model(path))`` restores it into the user's plain module."""
    files = _weight_files(path)
    if len(files) > 1:
        return {k: v for file in files for k, v in load_model(file, device).items()}
    p = files[0]
    try:
        return _safetensors().load_file(str(p), device=str(device))
    except ValueError:
        raise
    except Exception as e:  # safetensors' own error types for a damaged file
        raise CheckpointError(f"{str(p)!r} is not a readable safetensors file: {type(e).__name__}: {e}") from None


def _weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of an export (its folder, index or single file), in order."""
    p = Path(path)
    if p.is_dir():
        p = p / INDEX if (p / INDEX).is_file() else p / WEIGHTS
    if not p.is_file():
        raise FileNotFoundError(f"no exported model at {str(path)!r}: expected a folder holding {WEIGHTS} or {INDEX}")
    if p.name != INDEX:
        return [p]
    return [p.parent / name for name in dict.fromkeys(json.loads(p.read_text())["weight_map"].values())]


@torch.no_grad()
def load_weights(module: nn.Module, path: str | os.PathLike, strict: bool = True) -> None:
    """Copy the weights of an export (``model.safetensors``, HuggingFace's numbered files, or a
    ``save_pretrained`` folder's) into ``module`` in place, one tensor at a time: a sharded
    parameter (a DTensor: fsdp, tensor) takes only this rank's part of each tensor read, so no rank
    ever holds the whole model, also a module built on the meta device and materialised by
    ``pt.setup``. ``strict``: every entry of the module's ``state_dict`` must be in the files (a
    pipeline stage's are its own); entries of the files the module does not have are skipped."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    targets = module.state_dict(keep_vars=True)
    found: set[str] = set()
    for file in _weight_files(path):
        with _safetensors().safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                target = targets.get(key)
                if target is None:
                    continue
                value = f.get_tensor(key)
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"{key}: {str(file)!r} holds a tensor of shape {tuple(value.shape)}, the model "
                                     f"one of {tuple(target.shape)}: export the same model's weights")
                if isinstance(target, DTensor):  # this rank's part, cut from the tensor read: no communication
                    value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None).to_local()
                    target = target.to_local()
                target.copy_(value)
                found.add(key)
    loaded = {id(targets[k]) for k in found}  # a tied weight is loaded under any of its names (save_pretrained keeps one)
    missing = [k for k in targets if k not in found and id(targets[k]) not in loaded]
    if strict and missing:
        raise ValueError(f"{len(missing)} of the model's entries are not in {str(path)!r} (first: {missing[0]!r}): "
                         "give the weights of this model, or strict=False")


def _sharded_model(folder: Path) -> tuple[dict[str, int], Callable[[list[str]], dict[str, torch.Tensor]]]:
    """The model entries of a DCP checkpoint folder: their sizes in bytes, in order, and a reader of
    some of them as full tensors (DCP reads just those items' bytes), in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_metadata

    entries = {key.removeprefix("model."): m for key, m in read_metadata(folder / ".metadata").state_dict_metadata.items()
               if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    if not entries:
        raise CheckpointError(f"{str(folder)!r} holds no model tensors")

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        state = {key: torch.empty(entries[key].size, dtype=entries[key].properties.dtype) for key in keys}
        dcp.load({"model": state}, storage_reader=SafeFileSystemReader(str(folder)),
                 planner=SafeLoadPlanner(str(folder)), no_dist=True)
        return state

    sizes = {key: m.size.numel() * torch.empty((), dtype=m.properties.dtype).element_size() for key, m in entries.items()}
    return sizes, read


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


def export_checkpoint(source: str | os.PathLike, directory: str | os.PathLike,
                      max_shard_size: str | int = MAX_SHARD_SIZE, hf_config: str | os.PathLike | None = None) -> Path:
    """Export the model of ``source`` (a checkpoint file, a checkpoint folder: its newest good
    checkpoint, or a run folder holding ``checkpoints/``) to ``directory``, in files of at most
    ``max_shard_size``; ``hf_config``, a HuggingFace model folder (or its ``config.json``), gives the
    ``config.json`` (and ``generation_config.json``) copied beside them for ``from_pretrained``.
    Returns the weights' (or index's) path."""
    limit = parse_size(max_shard_size)
    config_files = _hf_files(hf_config)
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
    precision = state.get("precision") or {}
    masters, names = precision.get("masters"), precision.get("master_names")
    if state.get("sharded"):  # one file's tensors at a time, never the whole model
        sizes, read_sharded = _sharded_model(Path(path).parent / state["sharded"])
        read = lambda keys: _with_masters(read_sharded(keys), masters, names)  # noqa: E731
    else:
        weights = _with_masters(uncompiled_keys(state["model"]), masters, names)
        weights = {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
        sizes = {k: _nbytes(v) for k, v in weights.items()}
        read = lambda keys: {k: weights[k].detach().contiguous().clone() for k in keys}  # noqa: E731
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
    written = _write_model(directory, _files(sizes.items(), limit), sizes, read, info)
    for file in config_files:
        shutil.copyfile(file, Path(directory) / file.name)
    return written


def _hf_files(hf_config: str | os.PathLike | None) -> list[Path]:
    """The HuggingFace config files to copy: ``config.json`` (required) and ``generation_config.json``."""
    if hf_config is None:
        return []
    given = Path(hf_config)
    folder = given.parent if given.name == "config.json" else given
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--hf-config {str(hf_config)!r} holds no config.json: give the folder "
                                "model.save_pretrained (or model.config.save_pretrained) wrote")
    return [folder / name for name in HF_FILES if (folder / name).is_file()]
