"""``dp``: ``nn.DataParallel`` — one process, the batch scattered over the GPUs of this node.

It is often slower than one GPU (one CIFAR-10 run: 19.1 s vs 13.2 s per epoch): it replicates the model
every forward and gathers outputs on GPU 0. It is here for comparison; prefer ``ddp``.
On a machine with fewer than two GPUs it degenerates to the plain module (said once).

DataParallel runs each replica in a thread of its own and passes on only *whether* autocast is
on, not its dtype; autocast's dtype is per thread and defaults to float16 on CUDA. Under
``bf16-mixed``/``bf16-true`` the replicas would silently compute in float16 (without a loss
scaler). So the module DataParallel replicates re-enters autocast with the precision's dtype in
its forward, as torch's AMP notes ask for multi-GPU modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import Strategy

__all__ = ["DataParallelStrategy", "ReplicaAutocast"]


class ReplicaAutocast(nn.Module):
    """Runs ``module`` under autocast to ``dtype`` whenever autocast is on in the calling thread."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.device_type, self.dtype = device_type, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_autocast_enabled(self.device_type):
            return self.module(*args, **kwargs)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


class DataParallelStrategy(Strategy):
    name = "dp"
    processes = "one"
    drives_all_local_devices = True
    master_weights = True
    bench_default = "quick"

    def convert_batchnorm(self, model: nn.Module) -> nn.Module:
        self.warn("sync_batchnorm has no effect with dp: DataParallel replicas cannot sync BatchNorm; use ddp")
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        gpus = torch.cuda.device_count() if self.device.type == "cuda" else 0
        if gpus < 2:
            self.warn(
                f"dp: {gpus} GPU(s) visible on {self.device}, so DataParallel would change nothing; "
                "running the plain module"
            )
            return model
        # The model sits on this process's device, which DataParallel needs first in its list.
        first = self.device.index if self.device.index is not None else torch.cuda.current_device()
        devices = [first, *(i for i in range(gpus) if i != first)]
        dtype = self.precision.param_dtype
        if self.precision.autocast and dtype is not None:
            model = ReplicaAutocast(model, self.device.type, dtype)
        return nn.DataParallel(model, device_ids=devices)

    def unwrap(self, model: nn.Module) -> nn.Module:
        model = super().unwrap(model)
        return model.module if isinstance(model, ReplicaAutocast) else model
