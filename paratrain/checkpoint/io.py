"""Atomic checkpoint files with SHA-256 digests, a ``latest`` pointer, and loading that never
executes pickled code.

Layout of a checkpoint directory::

    step-00000040.pt      # streamed by torch.save to a temporary name, fsync'd, renamed
    step-00000040.dcp/    # fsdp/tensor/pipeline: every rank's shards (see sharded.py)
    step-00000040.sha256  # digests of all the files above, written after them
    step-00000080.pt
    step-00000080.sha256
    latest                # the name of the newest complete checkpoint, replaced last

Every file is written as ``<name>.tmp-<pid>`` and renamed, so a crash leaves only temporary
files behind (removed by the next save), and ``latest`` still names the previous checkpoint.
Loading checks a checkpoint's files against its manifest before torch reads them, reads the
``.pt`` with ``weights_only=True`` and DCP metadata with an unpickler that builds only metadata
(:mod:`.safe_dcp`); a checkpoint that fails any of this is reported in one line and the next
older one is tried.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from ..env.disk import StorageError, tensor_bytes, writing
from .errors import CheckpointError, load_error
from .manifest import SUFFIX, file_digest, format_manifest, fsync_dir, verify_manifest

__all__ = ["CheckpointError", "save_file", "load_file", "write_checkpoint", "load_latest", "newest_step", "list_checkpoints",
           "verify_checkpoint", "intact_note", "saved_bytes"]

_NAME = re.compile(r"^step-(\d{8,})\.pt$")
_LEFTOVER = re.compile(r"^(step-\d{8,}\.(pt|sha256)|latest)\.tmp-\d+$")  # a killed writer's temporary file
_LEFTOVER_DIR = re.compile(r"^step-\d{8,}\.dcp\.(tmp|old)$")  # a killed save_sharded's directory
_PART = re.compile(r"^step-(\d{8,})\.(dcp|sha256)$")  # a checkpoint's shards or manifest, beside its .pt
LATEST = "latest"


def _write_atomic(path: Path, write: Callable[[IO[bytes]], Any], needed: int | None = None,
                  after: str | Callable[[], str] = "", flag: str = "checkpoint folder") -> None:
    """``write(f)`` into ``path.tmp-<pid>``, fsync, rename over ``path``: all or nothing. A full disk,
    a read-only filesystem or an exceeded quota is one :class:`~paratrain.env.disk.StorageError`
    line (``needed``: the bytes being written; ``after`` ends the line; ``flag`` names the folder)."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    # on any failure (e.g. an object torch.save cannot serialize) leave nothing behind
    with writing(path, needed, cleanup=lambda: tmp.unlink(missing_ok=True), after=after, flag=flag):
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(path.parent)


def saved_bytes(obj: Any) -> int:
    """About the bytes ``torch.save(obj)`` writes: its tensors, plus the archive's records."""
    return tensor_bytes(obj) + 64 * 1024


def save_file(obj: Any, path: str | os.PathLike, after: str | Callable[[], str] = "") -> None:
    """``torch.save`` streamed to a temporary name, fsync, rename: all or nothing, and no
    in-memory copy of the serialized checkpoint. A full disk, read-only filesystem or exceeded
    quota is one line, which ``after`` (or what it returns) ends."""
    _write_atomic(Path(path), lambda f: torch.save(obj, f), saved_bytes(obj), after)


def load_file(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """Load a checkpoint with ``weights_only=True``; any problem is one :class:`CheckpointError` line."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        with warnings.catch_warnings():  # a file that is not torch's asks to "file an issue": our error says it all
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch's loader raises anything from EOFError to IndexError on a bad file
        raise load_error(f"checkpoint {str(path)!r}", e) from None


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in ``directory`` (their ``.pt`` files), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def _step(path: Path) -> int:
    m = _NAME.match(path.name)
    if m is None:
        raise CheckpointError(f"{str(path)!r} is not named like a checkpoint (step-XXXXXXXX.pt)")
    return int(m.group(1))


def _parts(path: Path) -> tuple[Path, Path]:
    """A checkpoint's shard directory and manifest, beside its ``.pt`` file."""
    return path.with_suffix(".dcp"), path.with_suffix(SUFFIX)


def _remove(path: Path) -> None:
    shards, manifest = _parts(path)
    path.unlink(missing_ok=True)  # first: from here on the checkpoint is not listed any more
    shutil.rmtree(shards, ignore_errors=True)
    manifest.unlink(missing_ok=True)


def _remove_leftovers(d: Path, step: int) -> None:
    """Temporary files and directories of a writer that was killed mid-save, and the shards and
    manifest of a checkpoint whose ``.pt`` is gone (a pruning killed half-way), but ``step``'s."""
    for p in d.iterdir():
        if _LEFTOVER.match(p.name):
            p.unlink(missing_ok=True)
        elif _LEFTOVER_DIR.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
        elif (m := _PART.match(p.name)) and int(m.group(1)) != step and not (d / f"step-{m.group(1)}.pt").exists():
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def write_checkpoint(directory: str | os.PathLike, step: int, obj: Any, keep: int = 3,
                     digests: dict[str, str] | None = None) -> Path:
    """Write ``step-XXXXXXXX.pt`` atomically, then its manifest, then point ``latest`` at it; keep
    the newest ``keep`` checkpoints up to this step.

    ``digests`` are the SHA-256 digests of the checkpoint's shard files, already written under
    ``step-XXXXXXXX.dcp/`` (names relative to ``directory``).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(d, step)  # called by the one writer, after every rank has finished its shards
    path = d / f"step-{step:08d}.pt"
    if not digests:  # a full checkpoint: shards of an earlier sharded save of this step are not its
        shutil.rmtree(_parts(path)[0], ignore_errors=True)
    after = functools.partial(intact_note, d, step)  # what a failed write says is left as it was
    try:
        save_file(obj, path, after)
        digests = {**(digests or {}), path.name: file_digest(path)}
        _write_atomic(_parts(path)[1], lambda f: f.write(format_manifest(digests)), after=after)
        _write_atomic(d / LATEST, lambda f: f.write(path.name.encode()), after=after)  # once the checkpoint is complete
    except StorageError:
        if _latest_name(d) != path.name:  # this step's files, never completed: their room back
            with contextlib.suppress(OSError):  # a read-only filesystem keeps them (and the previous checkpoint)
                _remove(path)
        raise
    # Checkpoints newer than this one (left by a run this one resumed before) are not counted.
    older = [p for p in list_checkpoints(d) if _step(p) <= step]
    for old in older[:-keep] if keep > 0 else []:
        _remove(old)
    return path


def intact_note(directory: str | os.PathLike, step: int) -> str:
    """What a failed save of ``step`` left as it was: the checkpoint a resume would load."""
    before = [c for c in _candidates(Path(directory)) if _step(c) != step]
    return f"the previous checkpoint {before[0].name} is intact" if before else "there is no earlier checkpoint"


def _latest_name(d: Path) -> str | None:
    try:
        return (d / LATEST).read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Check the checkpoint ``path`` (its ``.pt`` file) before anything of it is loaded: every file
    against the digests of its manifest, and its DCP metadata (if sharded) with the restricted
    unpickler. A checkpoint written without a manifest (older paratrain) is loaded unverified,
    with a warning; the loaders still never run pickled code."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    shards, manifest = _parts(path)
    if manifest.is_file():
        verify_manifest(manifest, path, shards)
    else:
        warnings.warn(f"checkpoint {str(path)!r} has no manifest {manifest.name!r}: its files cannot be checked "
                      "for corruption", stacklevel=3)
    if shards.is_dir():
        if not (shards / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {shards.name}/.metadata is missing")
        from .safe_dcp import read_metadata  # torch.distributed.checkpoint: 2 s to import, only when sharded

        read_metadata(shards / ".metadata")


def _candidates(d: Path) -> list[Path]:
    """The checkpoint ``latest`` names first, then the older ones, newest first."""
    candidates = list(reversed(list_checkpoints(d)))
    latest = _latest_name(d)
    if not latest:
        return candidates  # no pointer, or a garbled one: every checkpoint, newest first
    named = d / latest
    if named in candidates:  # newer ones than latest were never completed
        candidates = [named] + [c for c in candidates if _step(c) < _step(named)]
    return candidates


def newest_step(directory: str | os.PathLike) -> int | None:
    """The step of the checkpoint a resume tries first (the one ``latest`` names, else the newest),
    read from the names alone; None when ``directory`` holds none. :func:`load_latest` still
    verifies it (and falls back to an older one)."""
    candidates = _candidates(Path(directory))
    return _step(candidates[0]) if candidates else None


def load_latest(directory: str | os.PathLike, map_location: Any = "cpu") -> tuple[Path, Any] | None:
    """The newest good checkpoint in ``directory``; ``None`` if it holds none at all.

    ``latest`` is tried first; a checkpoint that fails its digests, is truncated, corrupt or
    refused is reported in one line and the next older one is tried. Raises
    :class:`CheckpointError` when there are checkpoints but none is good.
    """
    d = Path(directory)
    failures = []
    for path in _candidates(d):
        try:
            verify_checkpoint(path)
            found = path, load_file(path, map_location)
        except CheckpointError as e:
            failures.append(str(e))
            continue
        for failure in failures:  # reported once a good one is found: else the error below says it all
            warnings.warn(f"{failure}; using an older checkpoint", stacklevel=2)
        return found
    if failures:
        raise CheckpointError(f"no good checkpoint in {str(d)!r}: " + "; ".join(failures))
    return None
