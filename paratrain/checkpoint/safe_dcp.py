"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without running pickled code.

torch's ``FileSystemReader`` reads ``.metadata`` with plain ``pickle.load``, and its default load
planner reads non-tensor entries (an optimizer's ``lr``...) with ``torch.load(weights_only=False)``:
a crafted file would run code on resume. Here ``.metadata`` goes through an unpickler that builds
only DCP's own metadata classes, ``torch.Size``, torch dtypes/layouts/memory formats, paths and
plain containers; non-tensor entries through ``torch.load(weights_only=True)``. Anything else is
refused in one :class:`CheckpointError` line naming the file and the global it asked for.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .errors import CheckpointError, load_error

__all__ = ["read_metadata", "SafeFileSystemReader", "SafeLoadPlanner"]

_METADATA_MODULE = Metadata.__module__  # torch.distributed.checkpoint.metadata: every class in it
_ALLOWED = {
    (_StorageInfo.__module__, "_StorageInfo"),  # where each entry lies in which shard file
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a layout: a lookup by name
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    *((module, name) for module in ("pathlib", "pathlib._local")  # StorageMeta.checkpoint_id
      for name in ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")),
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _Forbidden(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and ((module, name) in _ALLOWED or _is_dcp_class(module, name)
                                or (module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS))):
            return super().find_class(module, name)
        raise _Forbidden(f"{module}.{name}")


def _is_dcp_class(module: str, name: str) -> bool:
    """A class defined in DCP's metadata module (not a helper it imports, such as ``dataclass``)."""
    obj = getattr(sys.modules[_METADATA_MODULE], name, None) if module == _METADATA_MODULE else None
    return isinstance(obj, type) and obj.__module__ == _METADATA_MODULE


def read_metadata(path: str | os.PathLike) -> Metadata:
    """Unpickle a DCP ``.metadata`` file, refusing any global that is not DCP metadata."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Forbidden as e:
        raise CheckpointError(f"DCP metadata {path!r} is refused: it references {e}, which is not checkpoint "
                              "metadata (a checkpoint could run code through it)") from None
    except FileNotFoundError:
        raise
    except Exception as e:  # truncated, random bytes, wrong arguments to an allowed class...
        raise load_error(f"DCP metadata {path!r}", e) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"DCP metadata {path!r} is corrupt: it holds a {type(metadata).__name__}, not Metadata")
    for info in (metadata.storage_data or {}).values():  # shard files: names inside the checkpoint directory
        name = getattr(info, "relative_path", None)
        if not (isinstance(info, _StorageInfo) and isinstance(name, str) and name not in ("", ".", "..")
                and os.path.basename(name) == name):
            raise CheckpointError(f"DCP metadata {path!r} is corrupt: a shard location {name!r} is not a file "
                                  "in the checkpoint directory")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` (global or per-rank) is read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self._get_metadata_path(kwargs.get("rank")))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()  # as torch's reader does
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with ``torch.load(weights_only=True)``."""

    def __init__(self, checkpoint: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise load_error(f"entry {fqn!r} of DCP checkpoint {self.checkpoint!r}", e) from None
        # DefaultLoadPlanner.load_bytes, with the safe load above (torch 2.13)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
