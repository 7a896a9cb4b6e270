"""Atomic checkpoint files, a ``latest`` pointer, and loading that never executes pickled code.

Layout of a checkpoint directory::

    step-00000040.pt    # written as .tmp, fsync'd, renamed: never seen half-written
    step-00000080.pt
    latest              # the name of the newest complete checkpoint, replaced last

A crash during a write leaves only a ``.tmp`` file behind, which is never loaded; ``latest``
still names the previous complete checkpoint.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "save_file", "load_file", "write_checkpoint", "load_latest", "list_checkpoints"]

_NAME = re.compile(r"^step-(\d{8,})\.pt$")
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, truncated, corrupt, or holding pickled code."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    # Test hook: die after writing this many bytes, as a killed writer would.
    crash_after = int(os.environ.get("PARATRAIN_TEST_CRASH_AFTER_BYTES", "-1"))
    with open(tmp, "wb") as f:
        if 0 <= crash_after < len(data):
            f.write(data[:crash_after])
            f.flush()
            os._exit(137)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_file(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary name, fsync, rename: all or nothing."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    _write_atomic(Path(path), buf.getvalue())


def load_file(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """Load a checkpoint with ``weights_only=True``; any problem is one :class:`CheckpointError` line."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(path)!r} is refused: it holds objects other than tensors and "
                              f"plain data (weights_only load: {first})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(path)!r} is truncated or corrupt: {first}") from None


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def write_checkpoint(directory: str | os.PathLike, step: int, obj: Any, keep: int = 3) -> Path:
    """Write ``step-XXXXXXXX.pt`` atomically, point ``latest`` at it, keep the newest ``keep``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step-{step:08d}.pt"
    save_file(obj, path)
    _write_atomic(d / LATEST, path.name.encode())  # updated only after the file is complete
    for old in list_checkpoints(d)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
        shutil.rmtree(old.with_suffix(".dcp"), ignore_errors=True)  # its shards, for sharded strategies
    return path


def load_latest(directory: str | os.PathLike, map_location: Any = "cpu") -> tuple[Path, Any] | None:
    """The newest loadable checkpoint in ``directory`` (``None`` if there is none).

    ``latest`` is tried first; a checkpoint that is truncated, corrupt or refused is reported in
    one line and the next older one is used instead.
    """
    d = Path(directory)
    candidates = list(reversed(list_checkpoints(d)))
    pointer = d / LATEST
    if pointer.is_file():
        named = d / pointer.read_text().strip()
        if named in candidates:  # try the pointed-to checkpoint first, then older ones
            candidates = [named] + [c for c in candidates if c != named and c.name < named.name]
    for path in candidates:
        try:
            return path, load_file(path, map_location)
        except CheckpointError as e:
            warnings.warn(f"{e}; falling back to an older checkpoint", stacklevel=2)
    return None
