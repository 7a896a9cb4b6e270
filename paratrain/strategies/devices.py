"""``devices``: seed 004's "network partitioning" — consecutive parts of one model on different
devices of one process, the activations moved from device to device in forward.

Seed 004's example, as a strategy::

    x = self.part1(x.to("cuda:0"))
    x = self.part2(x.to("cuda:1"))

It lets a model larger than one device's memory train in one process; only one device computes at
a time (``pipeline`` overlaps them with micro-batches across processes). The model is cut at its
top-level children like ``pipeline`` cuts it (``split_points``, or balanced by parameter count).
On a machine without GPUs every part lands on the CPU, through the same code and ``.to()`` moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from ..env.process import Dist
from ._split import check_sequential, is_plain_sequential, parse_split_points, split_model
from .base import Strategy

__all__ = ["DevicesOptions", "DeviceSplit", "DevicesStrategy", "default_devices"]


@dataclass(kw_only=True)
class DevicesOptions:
    """Devices settings."""

    devices: list[str] = field(default_factory=list)
    """One device per part, in forward order (e.g. ["cuda:0", "cuda:1"]). Empty: every visible
    CUDA device, or ["cpu", "cpu"] without one."""
    split_points: list[str] = field(default_factory=list)
    """Top-level children that start parts 2..N. Empty: parameter counts as even as possible."""

    def __post_init__(self) -> None:
        if isinstance(self.devices, str):  # from the command line: "cuda:0,cuda:1"
            self.devices = [d.strip() for d in self.devices.split(",") if d.strip()]
        for d in self.devices:
            try:
                torch.device(d)
            except (RuntimeError, TypeError):
                raise ValueError(f"devices: {d!r} is not a device: use names like cpu, cuda:0, cuda:1") from None
        self.split_points = parse_split_points(self.split_points, "devices")


def default_devices(process_device: torch.device) -> list[str]:
    """Every visible CUDA device when this process runs on CUDA, else two CPU parts."""
    if process_device.type == "cuda" and torch.cuda.device_count() > 0:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu", "cpu"]


class DeviceSplit(nn.Module):
    """``parts[i]`` on ``devices[i]``; forward moves the activations into each part's device and
    returns the output on ``output_device`` (where the batches and targets are)."""

    original: nn.Module

    def __init__(self, parts: Sequence[nn.Module], devices: list[torch.device], output_device: torch.device,
                 original: nn.Module) -> None:
        super().__init__()
        self.parts = nn.ModuleList(part.to(device) for part, device in zip(parts, devices))
        self.devices = list(devices)
        self.output_device = output_device
        object.__setattr__(self, "original", original)  # not a submodule: no duplicate parameters
        # The cut is checked against the model's own forward once, where that forward can run at all.
        self._check_pending = len(set(self.devices)) == 1 and not is_plain_sequential(original)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._check_pending:
            self._check_pending = False
            check_sequential(self.original, list(self.parts), x.to(self.devices[0]), "devices")
        for part, device in zip(self.parts, self.devices):
            x = part(x.to(device))
        return x.to(self.output_device)


class DevicesStrategy(Strategy):
    name = "devices"
    processes = "one"
    master_weights = True

    def __init__(self, dist_info: Dist, sync_batchnorm: bool = False, options: DevicesOptions | None = None) -> None:
        super().__init__(dist_info, sync_batchnorm, options or DevicesOptions())

    def setup_model(self, model: nn.Module) -> nn.Module:
        # No model.to(self.device): each part goes to its own device.
        if self.sync_batchnorm:
            self.warn("sync_batchnorm has no effect with devices: one process already sees the whole batch")
        return self.wrap(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        o: DevicesOptions = self.options
        devices = [torch.device(d) for d in (o.devices or default_devices(self.device))]
        parts = split_model(model, len(devices), o.split_points, "devices")
        return DeviceSplit(parts, devices, self.device, model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.original if isinstance(model, DeviceSplit) else model
