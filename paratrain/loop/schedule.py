"""LR schedule for a grown global batch: the linear scaling rule with warmup (Goyal et al. 2017).

When the global batch grows from ``base_batch`` to ``global_batch``, the learning rate is
multiplied by ``global_batch / base_batch`` and reached by a linear ramp over ``warmup_steps``.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["lr_scale", "warmup_linear_scaling"]


def lr_scale(global_batch: int, base_batch: int | None) -> float:
    return 1.0 if base_batch is None else global_batch / base_batch


def warmup_linear_scaling(
    optimizer: torch.optim.Optimizer, global_batch: int, base_batch: int | None = None, warmup_steps: int = 0
) -> LambdaLR:
    """Multiply every group's lr by ``global_batch/base_batch``, ramped linearly over ``warmup_steps``.

    During warmup the factor goes from ``1/warmup_steps`` of the target up to the target; with
    no warmup the scaled lr applies from the first step.
    """
    scale = lr_scale(global_batch, base_batch)

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
        return scale * ramp

    return LambdaLR(optimizer, factor)
