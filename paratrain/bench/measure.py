"""What a bench cell measures besides time: bytes communicated per step, and peak memory.

Bytes
    :class:`CommCounter` adds up, per training step, each communication call's size the way
    nccl-tests counts it: all-reduce, reduce and broadcast = the tensor, all-gather = the gathered
    output, reduce-scatter = the input, all-to-all and point-to-point = what this rank sends. It is
    a payload size per rank, not the bytes on the wire (a ring all-reduce sends about twice its
    payload). It sees the calls three ways, in the worker process (a fresh process per cell, so
    nothing else is affected):

    * ``torch.distributed``'s Python collectives are wrapped. DDP's comm hooks (fp16/bf16/
      PowerSGD) and FSDP's gathers go through them. DDP's built-in all-reduce (no hook) runs in
      C++, so for it the size of DDP's gradient buckets is added once per synchronising backward
      (read from DDP's own logging data, :func:`ddp_bucket_bytes`).
    * Point-to-point sends are counted in ``ProcessGroup.send``, which ``send``, ``isend``,
      ``batch_isend_irecv`` and so ``torch.distributed.pipelining`` (``pipeline``) all end in.
      ``dist.isend`` itself is left alone: ``P2POp`` accepts only the original function.
    * Functional collectives (``torch.ops._c10d_functional``, ``_c10d_functional_autograd``,
      ``_dtensor``), which DTensor (``tensor``) calls instead of those functions, are seen by a
      ``TorchDispatchMode`` (ops of ``torch.ops.c10d``, which the Python functions and DDP's
      reducer run on, are left to the two ways above, so nothing is counted twice; nor is a
      functional collective issued inside a wrapped call). The mode costs a few microseconds per
      op (about 12% of a ``tensor`` step of the default MLP on a 2-core CPU), so it stays out of
      the timed steps: it runs in the warm-up steps, and each timed step is credited the
      functional bytes of the last warm-up step (the same step on the same shapes). With no
      warm-up step it runs in the timed steps instead.

    * ``ps`` talks over RPC inside ``optimizer.step()``: its cells add the strategy's own
      ``bytes_per_step``, the gradient a rank pushes plus the parameters it pulls back.

    Both additions are each strategy's ``hidden_comm_bytes_per_step``, asked of the strategy.

Memory
    On CUDA, ``torch.cuda.max_memory_allocated`` after a reset at the end of warm-up. On CPU, the
    process's peak resident set size (``VmHWM``) over the timed steps: Linux resets that mark when
    ``5`` is written to ``/proc/self/clear_refs``; where that is not possible, the lifetime peak
    from ``resource.getrusage``. Both include the interpreter and torch itself (a few hundred MiB).
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..strategies.ddp import bucket_bytes as ddp_bucket_bytes
from ..trace.calls import COLLECTIVES, arg, group_name, group_of, nbytes, tensor_of, total_bytes

__all__ = ["CommCounter", "PeakMemory", "ddp_bucket_bytes", "group_name"]


def _size_of(name: str) -> Callable[[tuple, dict], int]:
    """The payload bytes of one call of ``torch.distributed.<name>`` (nccl-tests' count: :data:`COLLECTIVES`)."""
    return lambda a, k: total_bytes(tensor_of(name, a, k))


def _group_of(name: str) -> Callable[[tuple, dict], str]:
    """The group name of one call of ``torch.distributed.<name>`` from its (args, kwargs)."""
    of = group_of(name)
    return lambda a, k: group_name(of(a, k))


def _sent(a: tuple, k: dict) -> int:
    """Size of one ``ProcessGroup.send(self, tensors, dst, tag)``, where every Python send ends."""
    return total_bytes(arg(a, k, 1, "tensors") or [])


def _first(a: tuple) -> int:
    return nbytes(a[0])


def _gathered(a: tuple) -> int:  # (input(s), group_size, group_name): the gathered output
    return total_bytes(a[0]) * int(a[1])


def _p2p_sent(a: tuple) -> int:  # batch_p2p_ops(op_list, peer_list, tag_list, tensors, group_name)
    return sum(nbytes(t) for op, t in zip(a[0], a[3]) if op == "isend")


# functional collective op ("namespace::name") -> size of one call from its positional args
_FUNCTIONAL: dict[str, Callable[[tuple], int]] = {"_dtensor::shard_dim_alltoall": _first}
for _ns in ("_c10d_functional", "_c10d_functional_autograd"):
    for _name in ("all_reduce", "all_reduce_", "broadcast", "broadcast_", "reduce_scatter_tensor",
                  "reduce_scatter_tensor_out", "all_to_all_single", "isend"):
        _FUNCTIONAL[f"{_ns}::{_name}"] = _first
    for _name in ("all_reduce_coalesced", "all_reduce_coalesced_", "reduce_scatter_tensor_coalesced"):
        _FUNCTIONAL[f"{_ns}::{_name}"] = lambda a: total_bytes(a[0])
    for _name in ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"):
        _FUNCTIONAL[f"{_ns}::{_name}"] = _gathered
    _FUNCTIONAL[f"{_ns}::batch_p2p_ops"] = _p2p_sent


class _FunctionalCollectives(TorchDispatchMode):
    """Adds up the functional collectives dispatched while active, except those issued inside a
    wrapped ``torch.distributed`` call (``inside_wrapper()``), which the wrapper already counted."""

    supports_higher_order_operators = True

    def __init__(self, inside_wrapper: Callable[[], bool]) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor

        self.dtensor = DTensor
        self.inside_wrapper = inside_wrapper
        self.bytes = 0
        self.calls = 0
        self.by_group: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, self.dtensor) for t in types):
            return NotImplemented  # DTensor turns the op into local ops and collectives, which come back here
        size = _FUNCTIONAL.get(func.name())
        if size is not None and not self.inside_wrapper():
            nbytes = size(args)
            self.bytes += nbytes
            self.calls += 1
            name = next((a for a in reversed(args) if isinstance(a, str)), "")  # the group's name comes last
            self.by_group[name] = self.by_group.get(name, 0) + nbytes
        return func(*args, **kwargs)


class CommCounter:
    """Counts the payload bytes of the communication in the training steps run under :meth:`step`
    with ``count=True`` (see the module docstring for what is seen and how)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self.by_group: dict[str, int] = {}
        """Bytes per process group name ("" for the default group): :meth:`by_dimension` names them."""
        self.armed = False
        """True inside a counted step: the wrapped Python calls add their size."""
        self.functional_step: tuple[int, int, dict[str, int]] | None = None
        """(bytes, calls, bytes per group) of functional collectives in the last warm-up step; None before one ran."""
        self._originals: dict[str, Any] = {}
        self._send: Any = None
        self._local = threading.local()  # .depth: wrapped calls running on this thread

    def install(self) -> "CommCounter":
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None or name in self._originals or COLLECTIVES[name][0] < 0:  # no tensor: no bytes
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(original, _size_of(name), _group_of(name)))
        if self._send is None:
            self._send = dist.ProcessGroup.send
            dist.ProcessGroup.send = self._wrap(self._send, _sent, lambda a, k: group_name(a[0]))  # type: ignore[method-assign]
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
        if self._send is not None:
            dist.ProcessGroup.send = self._send  # type: ignore[method-assign]
            self._send = None

    def add(self, nbytes: int, calls: int = 1, group: str | dict[str, int] = "") -> None:
        """Count ``nbytes`` in a counted step: sent over ``group`` (its name), or split as a dict says."""
        if self.armed:
            self.bytes += int(nbytes)
            self.calls += calls
            for name, part in (group.items() if isinstance(group, dict) else [(group, int(nbytes))]):
                self.by_group[name] = self.by_group.get(name, 0) + part

    def by_dimension(self, dimensions: dict[str, str], extra: int = 0) -> dict[str, int]:
        """:attr:`by_group` under the names ``dimensions`` gives the groups (a layout's ``pp``, ``tp``...;
        a group it does not name is ``other``), with ``extra`` bytes the counter could not see in ``""``'s."""
        out: dict[str, int] = {}
        for name, size in [*self.by_group.items(), ("", extra)]:
            if size:
                dim = dimensions.get(name, "other")
                out[dim] = out.get(dim, 0) + size
        return out

    @contextlib.contextmanager
    def step(self, count: bool) -> Iterator[None]:
        """Run one training step inside; add its bytes to :attr:`bytes` when ``count``.

        Uncounted (warm-up) steps run under the functional-collective dispatch mode and record
        what it saw in :attr:`functional_step`; counted steps run without it and are credited
        that record, or, when no warm-up step ran, run under it themselves.
        """
        measure = not count or self.functional_step is None
        mode = _FunctionalCollectives(self._inside_wrapper) if measure else None
        self.armed = count
        try:
            with mode if mode is not None else contextlib.nullcontext():
                yield
            if mode is None:
                self.add(*self.functional_step)  # type: ignore[misc]
            elif count:
                self.add(mode.bytes, mode.calls, mode.by_group)
            else:
                self.functional_step = (mode.bytes, mode.calls, dict(mode.by_group))
        finally:
            self.armed = False

    def _inside_wrapper(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def _wrap(self, fn: Callable[..., Any], size: Callable[[tuple, dict], int],
              group: Callable[[tuple, dict], str]) -> Callable[..., Any]:
        local = self._local

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                self.add(size(args, kwargs), 1, group(args, kwargs))
            local.depth = getattr(local, "depth", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth -= 1

        counted.__name__ = getattr(fn, "__name__", "collective")
        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted


class PeakMemory:
    """Peak memory of this process between :meth:`reset` and :meth:`read`, in bytes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method = "cuda-max-allocated" if device.type == "cuda" else "rss"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            self.method = "rss-lifetime"

    def read(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.method == "rss":
            peak = _proc_status("VmHWM:")
            if peak is not None:
                return peak
            self.method = "rss-lifetime"
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux

    def current(self) -> int:
        """What this process holds now, in bytes: its resident set on CPU (0 where Linux's
        ``/proc`` does not say), the memory allocated on CUDA."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return _proc_status("VmRSS:") or 0


def _proc_status(key: str) -> int | None:
    """A size line of ``/proc/self/status`` (``VmHWM:``, ``VmRSS:``) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
