"""``single``: one process, one device — the reference every other strategy must match."""

from __future__ import annotations

from torch import nn

from .base import Strategy


class SingleDeviceStrategy(Strategy):
    name = "single"
    processes = "one"
    master_weights = True
    reference = True
    whole_layers = True
    bench_default = "quick"

    def convert_batchnorm(self, model: nn.Module) -> nn.Module:
        return model  # one process sees the whole batch: plain BatchNorm is already "synced"
