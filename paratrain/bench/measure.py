"""What a bench cell measures besides time: bytes communicated per step, and peak memory.

Bytes
    :class:`CommCounter` wraps ``torch.distributed``'s Python collectives in the worker process
    (a fresh process per cell, so nothing else is affected) and, while armed, adds up each call's
    size the way nccl-tests counts it: all-reduce and broadcast = the tensor, all-gather = the
    gathered output, reduce-scatter = the input, point-to-point = what this rank sends. DDP's
    comm hooks (fp16/bf16/PowerSGD) and FSDP's gathers go through these functions; DDP's built-in
    all-reduce (no hook) runs in C++, so for it the size of DDP's gradient buckets is added once
    per synchronising backward (read from DDP's own logging data). It is a payload size per rank,
    not the bytes on the wire (a ring all-reduce sends about twice its payload). DTensor's
    functional collectives (``tensor``) are not seen.

Memory
    On CUDA, ``torch.cuda.max_memory_allocated`` after a reset at the end of warm-up. On CPU, the
    process's peak resident set size (``VmHWM``) over the timed steps: Linux resets that mark when
    ``5`` is written to ``/proc/self/clear_refs``; where that is not possible, the lifetime peak
    from ``resource.getrusage``. Both include the interpreter and torch itself (a few hundred MiB).
"""

from __future__ import annotations

import os
import resource
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["CommCounter", "PeakMemory", "ddp_bucket_bytes"]


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _arg(args: tuple, kwargs: dict, index: int, *names: str) -> Any:
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return args[index] if len(args) > index else None


# function name -> size of one call from its (args, kwargs)
_SIZES: dict[str, Callable[[tuple, dict], int]] = {
    "all_reduce": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "broadcast": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "all_gather_into_tensor": lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")),
    "all_gather_single": lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")),
    "all_gather": lambda a, k: sum(_nbytes(t) for t in (_arg(a, k, 0, "tensor_list") or [])),
    "reduce_scatter_tensor": lambda a, k: _nbytes(_arg(a, k, 1, "input")),
    "reduce_scatter_single": lambda a, k: _nbytes(_arg(a, k, 1, "input")),
    "send": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "isend": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "batch_isend_irecv": lambda a, k: sum(_nbytes(op.tensor) for op in (_arg(a, k, 0, "p2p_op_list") or [])
                                          if getattr(op.op, "__name__", "") in ("isend", "send")),
}


class CommCounter:
    """Counts the payload bytes of ``torch.distributed`` collectives made while :attr:`armed`."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self.armed = False
        self._originals: dict[str, Any] = {}

    def install(self) -> "CommCounter":
        for name, size in _SIZES.items():
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(original, size))
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def add(self, nbytes: int) -> None:
        if self.armed:
            self.bytes += int(nbytes)
            self.calls += 1

    def _wrap(self, fn: Callable[..., Any], size: Callable[[tuple, dict], int]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                self.add(size(args, kwargs))
            return fn(*args, **kwargs)

        counted.__name__ = getattr(fn, "__name__", "collective")
        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """Bytes DDP's built-in reducer all-reduces per synchronising backward (all its buckets)."""
    for m in model.modules():
        if isinstance(m, torch.nn.parallel.DistributedDataParallel):
            sizes = str(m._get_ddp_logging_data().get("bucket_sizes", ""))
            return sum(int(s) for s in sizes.replace(" ", "").split(",") if s)
    return 0


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
            try:
                with open("/proc/self/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            return int(line.split()[1]) * 1024
            except OSError:
                pass
            self.method = "rss-lifetime"
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
