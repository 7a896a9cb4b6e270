"""Which device a process trains on and which collective backend joins it to the others.

``available_accelerator`` reads what torch sees (a CUDA build on a machine without a GPU sees none
and runs on the CPU); ``select_device`` turns the local rank into ``cuda:<local_rank>`` or the
CPU; ``select_backend`` picks torch's default backend for that device or checks the one asked for.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import UnavailableError

__all__ = ["BACKENDS", "available_accelerator", "select_backend", "select_device"]

BACKENDS = ("gloo", "nccl", "mpi", "xccl", "hccl")
"""The backends ``backend=`` may name besides ``auto``."""


def available_accelerator() -> tuple[str, int] | None:
    """The accelerator this process can use and how many devices it has, or ``None`` for CPU only.

    A CUDA (or XPU) build of torch on a machine without such a device still names its accelerator
    (``torch.accelerator.current_accelerator()`` says ``cuda``) but reports it as not available:
    that counts as none, and the job runs on the CPU.
    """
    acc_api = getattr(torch, "accelerator", None)
    if acc_api is not None and hasattr(acc_api, "is_available"):
        if not acc_api.is_available():
            return None
        acc = acc_api.current_accelerator()
        return None if acc is None else (acc.type, max(1, int(acc_api.device_count())))
    if torch.cuda.is_available():  # torch without torch.accelerator.is_available
        return "cuda", max(1, torch.cuda.device_count())
    return None


def select_device(local_rank: int, accelerator: str = "auto") -> torch.device:
    """``cuda:<local_rank>`` (or another accelerator) when one is present, else the CPU.

    ``accelerator="auto"`` takes the accelerator when there is one and the CPU otherwise; naming
    one (``cuda``, ``xpu``, ``mps``) that this machine does not have is an error.
    """
    if accelerator not in ("auto", "cpu", "cuda", "xpu", "mps"):
        raise ValueError(f"accelerator {accelerator!r} is unknown: use auto, cpu, cuda, xpu or mps")
    if accelerator == "cpu":
        return torch.device("cpu")
    found = available_accelerator()
    if found is None:
        if accelerator != "auto":
            raise UnavailableError(f"accelerator {accelerator!r} was asked for but this machine has none: use cpu")
        return torch.device("cpu")
    kind, count = found
    if accelerator != "auto" and kind != accelerator:
        raise UnavailableError(f"accelerator {accelerator!r} was asked for but this machine has {kind}: use {kind} or cpu")
    if kind == "mps":
        return torch.device("mps")
    return torch.device(kind, local_rank % count)


def select_backend(device: torch.device, requested: str | None = None) -> str:
    """``nccl`` on CUDA, ``xccl`` on XPU, otherwise ``gloo``; ``mpi``/``hccl`` when asked for."""
    if requested in (None, "auto"):
        return dist.Backend.default_device_backend_map.get(device.type, "gloo")
    if requested not in BACKENDS:
        raise ValueError(f"backend {requested!r} is unknown: use one of {', '.join(BACKENDS)} or auto")
    if requested == "mpi" and not dist.is_mpi_available():
        raise UnavailableError("backend 'mpi' was asked for but this torch build has no MPI support: use gloo")
    if requested == "nccl" and device.type != "cuda":
        raise UnavailableError(f"backend 'nccl' needs CUDA devices, but this process runs on {device}: use gloo")
    for backend, kind, where in (("xccl", "xpu", "a torch build with XPU support"), ("hccl", "npu", "torch_npu")):
        if requested == backend and device.type != kind:
            raise UnavailableError(f"backend {backend!r} needs {kind} devices, but this process runs on {device}: use gloo")
        if requested == backend and not dist.is_backend_available(backend):
            raise UnavailableError(f"backend {backend!r} was asked for but this torch does not have it: install {where}, "
                                   "or use gloo")
    return requested
