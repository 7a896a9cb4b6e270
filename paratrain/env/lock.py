"""One run per folder: ``.paratrain.lock`` in a run's log folder and checkpoint folder, held with
``fcntl.flock`` for the run's whole life.

The file says who holds it (``{"host", "pid", "started", "job"}``). A second run into the folder
is refused in one line naming the first one's host and PID (:class:`FolderInUseError`). The
kernel drops a lock when its process dies, so a killed run's file is *stale*: a run on the same
host takes it over with a one-line warning (silently when it is an earlier attempt of the same
job: a torchrun restart, a Slurm requeue). A file left by a run on another host is refused, naming
that host: its PID cannot be checked from here (where ``flock`` is not shared between hosts it
may still be running); remove the file when that run is gone. A run that ends releases its lock
and removes the file.

Who holds it: the process that owns the run. ``paratrain train`` holds its folders from before
the first write until it returns, across its workers' restarts; its workers find the lock held by
their launcher (``$PARATRAIN_AGENT_PID``, on their host) and use the folders as theirs. Without such a launcher (``torchrun``,
``srun``, a user's own loop), rank 0 of ``Parallel`` holds them (:class:`FolderLocks`), and every
rank raises the same one-line error when it cannot.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from .disk import StorageError, writing
from .process import AGENT_PID

__all__ = ["LOCK_FILE", "FolderInUseError", "FolderLock", "FolderLocks", "lock_folder", "job_id", "held"]

LOCK_FILE = ".paratrain.lock"
_Folder = TypeVar("_Folder", bound="str | os.PathLike[str] | None")
_BUSY = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


class FolderInUseError(ValueError):
    """The folder is another run's (its host and PID named), or was left by a run on another host."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock: what the lock file says."""

    host: str
    pid: int
    started: float
    job: str | None

    @classmethod
    def me(cls, job: str | None) -> Holder:
        return cls(socket.gethostname(), os.getpid(), time.time(), job)

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            d = json.loads(text)
            return cls(str(d["host"]), int(d["pid"]), float(d.get("started") or 0), d.get("job"))
        except (ValueError, KeyError, TypeError):
            return None

    def dumps(self) -> str:
        return json.dumps({"host": self.host, "pid": self.pid, "started": self.started, "job": self.job}) + "\n"

    def __str__(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "an unknown time"
        return f"host {self.host}, PID {self.pid}, started {since}"

    def alive(self) -> bool:
        """Whether the PID runs (on this host)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return True


def job_id() -> str | None:
    """The job this process belongs to, alike on all its workers and restarts (a Slurm requeue
    too): torchrun's rendezvous id, Slurm's job id, OpenMPI's namespace; or None."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    for value in ("" if run_id == "none" else run_id,
                  os.environ.get("SLURM_JOB_ID") and f"slurm-{os.environ['SLURM_JOB_ID']}",
                  os.environ.get("PMIX_NAMESPACE")):
        if value:
            return value
    return None


class FolderLock:
    """A held lock: the open, ``flock``-ed lock file (shared by every hold of it in this process)."""

    def __init__(self, folder: str, fd: int | None, holder: Holder, made: bool = False) -> None:
        self.folder, self.fd, self.holder, self.count = folder, fd, holder, 1
        self.made = made  # the folder was made for the lock: removed with it when nothing else was written there

    @property
    def path(self) -> str:
        return os.path.join(self.folder, LOCK_FILE)

    def release(self) -> None:
        """Give up one hold; the last removes the file (while still holding it: a run waiting
        for it then finds the file gone and opens the new one) and unlocks."""
        self.count -= 1
        if self.count > 0 or self.fd is None:
            return
        _HELD.pop(self.folder, None)
        fd, self.fd = self.fd, None
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                os.remove(self.path)
        os.close(fd)
        if self.made:
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)  # only when empty


_HELD: dict[str, FolderLock] = {}  # folder (real path) -> this process's lock of it


@atexit.register
def _release_at_exit() -> None:
    for lock in list(_HELD.values()):
        if lock.holder.pid != os.getpid():  # a forked child (a DataLoader worker): the lock is its parent's
            continue
        lock.count = 1
        with contextlib.suppress(OSError):
            lock.release()


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode("utf-8", "replace")


def _flock(fd: int) -> bool | None:
    """Lock ``fd`` without waiting: True when held, False when another process holds it, None on a
    filesystem without ``flock`` (some network filesystems: the file's contents decide alone)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        return False if e.errno in _BUSY else None


def _holder_of(fd: int) -> Holder | None:
    """What a running holder wrote (it writes right after locking: a moment's wait)."""
    for _ in range(20):
        holder = Holder.parse(_read(fd))
        if holder is not None:
            return holder
        time.sleep(0.05)
    return None


def lock_folder(folder: str | os.PathLike, what: str = "run folder", flag: str = "folder") -> FolderLock | None:
    """Hold ``folder`` (made if missing) for this run: the held :class:`FolderLock` (release it at
    the end), or None when the ``paratrain train`` that started this worker holds it.

    Raises :class:`FolderInUseError` (one line naming the holder's host and PID) when another run
    holds it or a run on another host left it; takes over, with a one-line warning, a lock that a
    dead process of this host left. ``what`` and ``flag`` name the folder and its setting in
    the messages (``"checkpoint folder"``, ``"--checkpoint-dir"``)."""
    path = os.path.join(folder, LOCK_FILE)
    made = not os.path.isdir(folder)
    with writing(path, flag=flag):
        os.makedirs(folder, exist_ok=True)
    key = os.path.realpath(folder)
    if key in _HELD:
        _HELD[key].count += 1
        return _HELD[key]
    job = job_id()
    while True:
        with writing(path, flag=flag):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            held = _flock(fd)
            if held is False:
                holder = _holder_of(fd)
                if holder is not None and _my_launcher(holder):
                    os.close(fd)
                    return None  # our launcher's: its workers write here
                raise FolderInUseError(_in_use(folder, what, flag, holder))
            with contextlib.suppress(OSError):
                if os.fstat(fd).st_ino != os.stat(path).st_ino:  # its holder removed it meanwhile: lock the new one
                    os.close(fd)
                    continue
            left = Holder.parse(_read(fd))
            if left is not None:
                _take_over(folder, what, flag, left, job, locked=held is True)
            me = Holder.me(job)
            with writing(path, flag=flag):
                os.ftruncate(fd, 0)
                os.pwrite(fd, me.dumps().encode(), 0)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        lock = _HELD[key] = FolderLock(key, fd, me, made)
        return lock


def _my_launcher(holder: Holder) -> bool:
    """Whether ``holder`` is the ``paratrain train`` that started this worker."""
    return holder.host == socket.gethostname() and str(holder.pid) == os.environ.get(AGENT_PID)


def _in_use(folder: str | os.PathLike, what: str, flag: str, holder: Holder | None) -> str:
    who = f"another run ({holder})" if holder is not None else "another run"
    gone = ("; its PID is gone, but a process it started still holds the lock"
            if holder is not None and holder.host == socket.gethostname() and not holder.alive() else "")
    return (f"{what} {os.fspath(folder)!r} is in use by {who}{gone}: wait for it to end, or choose another {flag}")


def _take_over(folder: str | os.PathLike, what: str, flag: str, left: Holder, job: str | None, locked: bool) -> None:
    """A lock file its holder left without releasing (``locked``: the lock itself is free; else
    the filesystem has no ``flock``): take it over, unless a run on another host left it (it may be
    running there) or, without ``flock``, its PID still runs here."""
    if left.job and left.job == job:
        return  # an earlier attempt of this job (a restart, a requeue)
    here = left.host == socket.gethostname()
    if here and not locked and left.pid != os.getpid() and left.alive():
        raise FolderInUseError(_in_use(folder, what, flag, left))
    if not here:
        raise FolderInUseError(
            f"{what} {os.fspath(folder)!r} is in use by a run on another host ({left}), which cannot be checked "
            f"from here: choose another {flag}, or remove {os.path.join(os.fspath(folder), LOCK_FILE)!r} if that run "
            "has ended")
    state = "is gone" if not left.alive() else "no longer holds it"
    warnings.warn(f"{what} {os.fspath(folder)!r}: taking over the lock of a run that ended without releasing it "
                  f"({left}; the PID {state})", stacklevel=3)


_OWNERS: weakref.WeakKeyDictionary[Any, FolderLocks] = weakref.WeakKeyDictionary()


def held(owner: Any) -> FolderLocks:
    """The folders ``owner`` (a ``Parallel``: its ``rank`` and ``world_size``) holds, made on first use."""
    if owner not in _OWNERS:
        _OWNERS[owner] = FolderLocks(owner.rank, owner.world_size)
    return _OWNERS[owner]


class FolderLocks:
    """The folders a run holds, for ``Parallel``: rank ``rank`` of ``world_size`` (rank 0 holds
    them; the others wait for its answer, so every rank raises the same one-line error)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.held: dict[str, FolderLock | None] = {}

    def hold(self, folder: str | os.PathLike | None, what: str = "run folder", flag: str = "folder") -> FolderLocks:
        """Hold ``folder`` (nothing for None or one held already); a collective the first time."""
        if folder is None or os.fspath(folder) in self.held:
            return self
        failure: BaseException | None = None
        said: list[Any] = [None]
        if self.rank == 0:
            try:
                self.held[os.fspath(folder)] = lock_folder(folder, what, flag)
            except (FolderInUseError, StorageError) as e:
                failure, said[0] = e, (type(e).__name__, str(e), getattr(e, "errno", None))
        else:
            self.held[os.fspath(folder)] = None
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(said, src=0)
        if failure is not None:
            raise failure
        if said[0] is not None:
            kind, line, code = said[0]
            raise FolderInUseError(line) if kind == "FolderInUseError" else StorageError(line, code)
        return self

    def __call__(self, folder: _Folder, what: str = "checkpoint folder") -> _Folder:
        """``folder``, held (:meth:`hold`): ``save(locks(directory), ...)``."""
        self.hold(folder, what)
        return folder

    def release(self) -> None:
        """Give up every folder held."""
        for lock in self.held.values():
            if lock is not None:
                lock.release()
        self.held.clear()
