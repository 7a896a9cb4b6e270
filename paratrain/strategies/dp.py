"""``dp``: ``nn.DataParallel`` — one process, the batch scattered over the GPUs of this node.

Seed 000 measured it slower than one GPU (19.1 s vs 13.2 s per epoch): it replicates the model
every forward and gathers outputs on GPU 0. It is here for comparison; prefer ``ddp``.
On a machine with fewer than two GPUs it degenerates to the plain module (said once).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Strategy


class DataParallel(Strategy):
    name = "dp"
    processes = "one"

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
        return nn.DataParallel(model)
