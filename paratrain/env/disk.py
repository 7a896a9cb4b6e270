"""Disk errors as one line: a full disk, a read-only filesystem or an exceeded quota, named with the
folder, the bytes a write needed and the bytes free.

Every writer of a run (checkpoint files, DCP shards, exported weights, the run folder, CSV and
tracker files) writes inside :func:`writing`, which turns such a failure into a
:class:`StorageError`. ``torch.save`` reports a full disk as ``RuntimeError: [enforce fail at
inline_container.cc] . unexpected pos ...`` without the ``OSError``; so besides the errno (of the
error or of one it wraps), the free space is measured after a write fails: a disk with less room
than the write needed was full, whatever the message says. :func:`check_room` warns before a run
when a folder cannot hold what it will write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import warnings
from typing import Any, Callable, Iterator

import torch

__all__ = ["StorageError", "writing", "storage_error", "free_bytes", "tensor_bytes", "check_room", "size_text"]

# errno -> (what happened, what to do)
_CAUSES = {
    errno.ENOSPC: ("the disk is full", "free space"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space under your quota"),
    errno.EROFS: ("the filesystem is read-only", "remount it writable"),
}
_NOT_WRITES = (KeyboardInterrupt, SystemExit, GeneratorExit)  # never a write's failure (DCP's is a BaseException)
_FULL_BELOW = 64 * 1024  # free bytes left when a write failed: below this the disk was full


class StorageError(OSError):
    """A write that failed because the disk is full, the filesystem read-only or the quota
    exceeded: one line naming the folder, the bytes needed and free. An ``OSError`` (its
    ``errno`` is ``ENOSPC``, ``EDQUOT`` or ``EROFS``), so ``except OSError`` still catches it."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.errno = code

    def __str__(self) -> str:
        return str(self.args[0])


def size_text(n: int) -> str:
    """``n`` bytes for a person: ``812 bytes``, ``161.4 KiB``, ``2.3 GiB``."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _existing(path: str | os.PathLike) -> str:
    """``path`` or its nearest part that exists (the folder a new file or folder goes into)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return probe


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes free for this user on the filesystem of ``path`` (or of its nearest existing part); None if unknown."""
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return None


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (nested dicts, lists, tuples): what ``torch.save`` writes, less
    its small headers."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _disk_errno(error: BaseException | None, seen: int = 0) -> int | None:
    """The ENOSPC/EDQUOT/EROFS of ``error``, of an error it wraps (``__cause__``, ``__context__``),
    or of a rank's failure inside DCP's ``CheckpointException`` (``failures``)."""
    if error is None or seen > 8:
        return None
    if isinstance(error, OSError) and error.errno in _CAUSES:
        return error.errno
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            code = _disk_errno(failure[0] if isinstance(failure, tuple) else failure, seen + 1)
            if code is not None:
                return code
    return _disk_errno(error.__cause__, seen + 1) or _disk_errno(error.__context__, seen + 1)


def storage_error(error: BaseException, path: str | os.PathLike, needed: int | None = None, *,
                  free_at_failure: int | None = None, after: str = "", flag: str = "folder") -> StorageError | None:
    """``error``, raised writing ``path``, as one :class:`StorageError` line if the disk was full, the
    filesystem read-only or the quota exceeded; else None.

    ``needed``: the bytes the write needed (as known or estimated); ``free_at_failure``: the bytes
    free right after the write failed, before its partial file was removed (a full disk shows 0
    there whatever the error said); ``after``: what the line says next (``the previous checkpoint
    ... is intact``); ``flag``: the setting to change (``--checkpoint-dir``)."""
    if isinstance(error, StorageError):
        return None  # said already, by a writer further in
    code = _disk_errno(error)
    free = free_bytes(path)
    if code is None:
        if isinstance(error, _NOT_WRITES) or (isinstance(error, OSError) and error.errno is not None):
            return None  # an interrupt, or another OSError (no such file...): it says itself what it is
        ran_out = free_at_failure is not None and free_at_failure < _FULL_BELOW
        if not (ran_out or (needed is not None and free is not None and free < needed)):
            return None
        code = errno.ENOSPC  # the write failed on a disk without the room it needed: whatever torch said
    cause, advice = _CAUSES[code]
    full = os.path.abspath(path)
    where = f"in {full!r}" if os.path.isdir(full) else f"{os.path.basename(full)} in {os.path.dirname(full)!r}"
    sizes = ", ".join(part for part in (f"needs about {size_text(needed)}" if needed else "",
                                        f"{size_text(free)} free" if free is not None else "") if part)
    line = f"cannot write {where}: {cause}" + (f" ({sizes})" if sizes else "")
    return StorageError(f"{line}{'; ' + after if after else ''}: {advice}, or choose another {flag}", code)


@contextlib.contextmanager
def writing(path: str | os.PathLike, needed: int | None = None, *, cleanup: Callable[[], Any] | None = None,
            after: str | Callable[[], str] = "", flag: str = "folder") -> Iterator[None]:
    """Write ``path`` inside: a full disk, read-only filesystem or exceeded quota becomes one
    :class:`StorageError` line (:func:`storage_error`); any other error passes unchanged.
    ``cleanup`` runs on every failure (it removes the partial file: after the free space is
    measured); ``after``, or what it returns, ends the line."""
    try:
        yield
    except BaseException as e:
        at_failure = free_bytes(path)
        if cleanup is not None:
            with contextlib.suppress(OSError):
                cleanup()
        why = storage_error(e, path, needed, free_at_failure=at_failure, flag=flag,
                            after=after() if callable(after) else after) if not isinstance(e, _NOT_WRITES) else None
        if why is not None:
            raise why from e
        raise


def check_room(folder: str | os.PathLike, needed: int, what: str, count: int = 2, flag: str = "folder") -> bool:
    """Warn in one line when ``folder``'s filesystem has less room than ``count`` times ``needed``
    bytes (``what``: ``checkpoints``); True when it has room (or the free space is unknown)."""
    free = free_bytes(folder)
    if free is None or free >= count * needed:
        return True
    warnings.warn(f"{os.fspath(folder)!r} has {size_text(free)} free, less than {count} {what} of about "
                  f"{size_text(needed)} each: a save there can fail on a full disk (the previous one stays intact); "
                  f"free space, or choose another {flag}", stacklevel=2)
    return False
