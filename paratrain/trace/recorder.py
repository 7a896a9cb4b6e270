"""Each rank's last collectives, always on: op, process group, sequence number, size, dtype, the
step, the state and the user's source line, in a ring that survives the process.

What is recorded
    Every call of ``torch.distributed``'s collective functions (:data:`~paratrain.trace.calls.COLLECTIVES`)
    made from Python: the user's own, paratrain's, FSDP2's gathers and reduce-scatters, DDP's comm
    hooks. DDP's built-in all-reduce runs in C++, so :func:`ddp_hook` takes its place on
    paratrain's ``ddp``: the same sum, scaled as DDP scales it, recorded as DDP's. Not recorded:
    point-to-point sends (the pipeline's activations), RPC, and DTensor's functional collectives,
    which bypass those functions (the same on every rank: the sequence numbers stay aligned).

Each record is written *before* the collective starts and marked done when it returns (an
``async_op`` call is marked issued), so a rank that waits forever or dies inside one (gloo aborts
the process on a size mismatch) leaves it there. The ring is a file (``PARATRAIN_TRACE_DIR``, set
by ``paratrain run``, ``train`` and ``paratrain.launch``: ``rank-N.trace``) mapped into memory:
a record costs a few microseconds and no system call, and the kernel keeps what was written when
the process is killed. Without that variable the ring is in memory, for the line a rank prints
when it times out (:mod:`paratrain.env.failures`).
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from .calls import COLLECTIVES, group_name, group_of, tensor_of

__all__ = ["Record", "Recorder", "CollectiveMismatchError", "start", "stop", "active", "original", "read_file", "read_dir", "ddp_hook", "TRACE_DIR",
           "SWITCH", "set_position"]

TRACE_DIR = "PARATRAIN_TRACE_DIR"
"""Where each rank's ring lives (``rank-N.trace``); set by paratrain's launchers."""
SWITCH = "PARATRAIN_TRACE"
"""``0`` turns the record off (it is on by default)."""

STARTED, DONE, ISSUED = 1, 2, 3
STATES = {STARTED: "started", DONE: "done", ISSUED: "issued"}  # 0: an empty slot

_MAGIC = b"PTTRACE1"
_HEADER = struct.Struct("<8siiiq")  # magic, rank, world, slots, records written
_RECORD = struct.Struct("<qqqdiB3x16s24s24s12s100s")  # seq, step, numel, time, micro, state; by, op, group, dtype, where
_SLOT = 256
_HEAD = 64
SLOTS = 1024


@dataclass
class Record:
    """One collective on one rank."""

    rank: int
    seq: int
    """Its number on its process group, counted from 1 on each rank: the same collective has the same number everywhere."""
    op: str
    group: str
    numel: int
    """Elements of the tensor it carries (-1: none, a barrier or an object collective)."""
    dtype: str
    step: int
    """The optimizer steps taken (``Parallel.global_step``) when it was called."""
    micro: int
    state: str
    """started (waiting in it, or died there), done, or issued (``async_op``: waited on elsewhere)."""
    by: str
    """Who called it: ``DDP``, ``FSDP``, ``pipeline``, ``DTensor``, ``checkpoint``, ``paratrain`` or "" (the user's code)."""
    where: str
    """The user's source line (``train.py:42``) the call came from; "" when none is on the stack (a GPU's backward thread)."""
    time: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_position: Callable[[], tuple[int, int]] = lambda: (0, 0)  # noqa: E731


def set_position(position: Callable[[], tuple[int, int]]) -> None:
    """Where the loop stands, ``(global step, micro-step)``, asked at each record (the last ``Parallel`` made)."""
    global _position
    _position = position


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_PARTS = (("ddp_comm_hooks", "DDP"), (os.sep + "nn" + os.sep + "parallel" + os.sep, "DDP"),
                (os.sep + "fsdp" + os.sep, "FSDP"), (os.sep + "pipelining" + os.sep, "pipeline"),
                (os.sep + "tensor" + os.sep, "DTensor"), (os.sep + "checkpoint" + os.sep, "checkpoint"))


def caller_of_frames(frames: Iterable[tuple[str, int]]) -> tuple[str, str]:
    """``(by, where)`` of a call from its stack, innermost first (``(file, line)`` pairs): the innermost
    library on it (torch's part or paratrain; "" for the user's own call) and the first line outside torch
    and paratrain (``train.py:42``; "" when there is none)."""
    by = None
    for path, line in frames:
        if path.startswith(_TORCH_DIR):
            if by is None:  # torch.distributed's own functions name nobody: the caller does
                by = next((who for part, who in _TORCH_PARTS if part in path), None)
        elif path.startswith(_OWN_DIR):
            if by is None:
                by = "paratrain"
        elif not path.startswith("<frozen"):
            return by or "", f"{os.path.basename(path)}:{line}"
    return by or "", ""


def _frame_above(depth: int) -> Any:
    """The frame ``depth`` levels above the one that calls this, or the outermost one where the stack is
    shorter: a hook that the autograd engine calls on its own device thread (DDP's comm hook, on CUDA)
    has no Python caller above it, and ``sys._getframe(depth)`` would raise."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame.f_back is None:
            break
        frame = frame.f_back
    return frame


def _stack(frame: Any) -> Iterator[tuple[str, int]]:
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back


def _text(b: bytes) -> str:
    return b.rstrip(b"\0").decode("utf-8", "replace")


def _fit(s: str, n: int) -> bytes:
    b = s.encode("utf-8", "replace")
    return b if len(b) <= n else b[: n - 3] + b"..."


class Recorder:
    """A ring of ``slots`` records: in the file ``path`` (mapped), or in memory."""

    def __init__(self, rank: int, world: int, path: str | None = None, slots: int = SLOTS) -> None:
        self.rank, self.world, self.slots, self.path = rank, world, slots, path
        size = _HEAD + slots * _SLOT
        self._file = None
        if path is not None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                self.buf: Any = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        else:
            self.buf = bytearray(size)
        _HEADER.pack_into(self.buf, 0, _MAGIC, rank, world, slots, 0)
        self.written = 0
        self.seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self.checking = False
        """Checked mode (``Parallel(check_collectives=True)``): :meth:`check` each collective before it runs."""

    def enter(self, op: str, group: Any, tensor: Any, by: str | None = None, depth: int = 2) -> int:
        """Write the record of a collective about to start; its number (for :meth:`leave`)."""
        name = group_name(group if group is not None else dist.group.WORLD)
        if isinstance(tensor, (list, tuple)):
            first = tensor[0] if tensor and isinstance(tensor[0], torch.Tensor) else None
            numel = sum(t.numel() for t in tensor if isinstance(t, torch.Tensor)) if first is not None else -1
        else:
            first, numel = (tensor, tensor.numel()) if isinstance(tensor, torch.Tensor) else (None, -1)
        dtype = str(first.dtype).replace("torch.", "") if first is not None else ""
        found_by, where = caller_of_frames(_stack(_frame_above(depth)))
        step, micro = _position()
        with self._lock:
            seq = self.seq[name] = self.seq.get(name, 0) + 1
            index = self.written
            _RECORD.pack_into(self.buf, _HEAD + (index % self.slots) * _SLOT, seq, step, numel, time.time(), micro, STARTED,
                              _fit(by if by is not None else found_by, 16), _fit(op, 24), _fit(name, 24),
                              _fit(dtype, 12), _fit(where, 100))
            self.written += 1
            struct.pack_into("<q", self.buf, 20, self.written)
        return index

    def leave(self, index: int, state: int = DONE) -> None:
        """Mark record ``index`` (:meth:`enter`'s) ``state``, unless the ring has written over it since."""
        if 0 <= index and self.written - index <= self.slots:
            self.buf[_HEAD + (index % self.slots) * _SLOT + 36] = state  # the state byte (after seq, step, numel, time, micro)

    def record(self, index: int) -> Record:
        """Record ``index`` (:meth:`enter`'s)."""
        at = _HEAD + (index % self.slots) * _SLOT
        return _parse_one(self.rank, bytes(self.buf[at:at + _RECORD.size]))

    def check(self, index: int, group: Any) -> None:
        """Checked mode: every rank of ``group`` shows the others the collective it is about to run
        (record ``index``); where they differ (a skipped collective, other sizes or dtypes, another op),
        :class:`CollectiveMismatchError` on every rank, before the collective could hang or abort."""
        from .analyze import first_divergence

        mine = self.record(index).as_dict()
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.distributed_c10d.all_gather_object(every, mine, group=group)
        finding = first_divergence({d["rank"]: [Record(**d)] for d in every})
        if finding is not None:
            raise CollectiveMismatchError(finding.line)

    def records(self) -> list[Record]:
        """What the ring holds, oldest first."""
        return _parse(bytes(self.buf))

    def last(self, n: int) -> list[Record]:
        return self.records()[-n:]

    def close(self) -> None:
        if isinstance(self.buf, mmap.mmap):
            self.buf.flush()


class CollectiveMismatchError(RuntimeError):
    """Checked mode: the ranks were about to run different collectives (or sizes, dtypes): one line."""


def _parse_one(rank: int, data: bytes) -> Record:
    seq, step, numel, when, micro, state, by, op, group, dtype, where = _RECORD.unpack_from(data, 0)
    return Record(rank, seq, _text(op), _text(group), numel, _text(dtype), step, micro, STATES.get(state, "?"),
                  _text(by), _text(where), when)


def _parse(data: bytes) -> list[Record]:
    if len(data) < _HEAD or data[:8] != _MAGIC:
        return []
    _, rank, _, slots, written = _HEADER.unpack_from(data, 0)
    out = []
    for k in range(max(0, written - slots), written):
        at = _HEAD + (k % slots) * _SLOT
        if at + _RECORD.size > len(data):
            break
        record = _parse_one(rank, data[at:at + _RECORD.size])
        if record.state != "?":
            out.append(record)
    return out


def read_file(path: str) -> list[Record]:
    """The records of one rank's ring file, oldest first ([] for a file that is not one)."""
    try:
        with open(path, "rb") as f:
            return _parse(f.read())
    except OSError:
        return []


def read_dir(folder: str) -> dict[int, list[Record]]:
    """Every rank's records in ``folder`` (``rank-N.trace``)."""
    out: dict[int, list[Record]] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if name.startswith("rank-") and name.endswith(".trace"):
            records = read_file(os.path.join(folder, name))
            if records:
                out[records[0].rank] = records
    return out


# --------------------------------------------------------------------------- the wrapped functions

_active: Recorder | None = None
_originals: dict[str, Any] = {}


def active() -> Recorder | None:
    """This process's recorder (None before :func:`start`)."""
    return _active


def original(name: str) -> Any:
    """``torch.distributed.<name>`` as torch defines it: unrecorded, and unseen by any other wrapper of
    ``torch.distributed``'s attributes (``bench``'s byte counter counts DDP's all-reduce on its own)."""
    return getattr(dist.distributed_c10d, name)


def _wrap(name: str, fn: Any) -> Any:
    tensor = lambda a, k: tensor_of(name, a, k)  # noqa: E731
    group = group_of(name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        rec = _active
        if rec is None:
            return fn(*args, **kwargs)
        g = group(args, kwargs)
        slot = rec.enter(name, g, tensor(args, kwargs))
        if rec.checking:
            rec.check(slot, g)
        out = fn(*args, **kwargs)
        rec.leave(slot, ISSUED if kwargs.get("async_op") else DONE)
        return out

    recorded.__name__ = getattr(fn, "__name__", name)
    recorded.__qualname__ = recorded.__name__
    recorded.__doc__ = fn.__doc__
    recorded.__wrapped__ = fn  # type: ignore[attr-defined]
    return recorded


def start(rank: int, world: int) -> Recorder | None:
    """Record this process's collectives from now on (a second call for the same rank and world keeps the
    ring); None, recording nothing, where ``PARATRAIN_TRACE=0``."""
    global _active
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if _active is not None and (_active.rank, _active.world) == (rank, world):
        return _active
    folder = os.environ.get(TRACE_DIR)
    path = None
    if folder:
        try:
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank-{rank}.trace")
        except OSError:
            path = None
    try:
        rec = Recorder(rank, world, path)
    except OSError:  # a full disk or a read-only folder: keep the ring in memory
        rec = Recorder(rank, world, None)
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and name not in _originals:
            _originals[name] = fn
            setattr(dist, name, _wrap(name, fn))
    _active = rec
    return rec


def stop() -> None:
    """Stop recording and give ``torch.distributed`` its own functions back."""
    global _active
    if _active is not None:
        _active.close()
    _active = None
    for name, fn in _originals.items():
        setattr(dist, name, fn)
    _originals.clear()


def ddp_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses annotations other than its own classes
    """A DDP comm hook that does what DDP's built-in one does, recorded as DDP's all_reduce: each
    gradient scaled by ``1 / world`` (as DDP scales them into its bucket), then summed.
    ``state``: the process group (None: the default)."""
    group = state
    tensor = bucket.buffer()
    size = dist.get_world_size(group)
    rec = _active
    slot = rec.enter("all_reduce", group, tensor, by="DDP") if rec is not None else -1
    if rec is not None and rec.checking:
        rec.check(slot, group)
    tensor.mul_(1.0 / size)
    work = original("all_reduce")(tensor, group=group, async_op=True)

    def done(fut: Any) -> Any:
        if rec is not None:
            rec.leave(slot, DONE)
        return fut.value()[0]

    if rec is not None:
        rec.leave(slot, ISSUED)
    return work.get_future().then(done)
