"""LR schedules for ``paratrain train``: constant, cosine, linear decay or step, after a linear
warmup, with the linear scaling rule for a grown global batch and its gradual warmup from the
base lr (Goyal et al. 2017).

Everything is one :class:`torch.optim.lr_scheduler.LambdaLR` over the optimizer's own lr, so its
state (``last_epoch``) goes into checkpoints like any scheduler's, and it steps once per
optimizer step (``fit`` steps it only on real steps, whatever the accumulation).
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..config import SCHEDULES

__all__ = ["SCHEDULES", "lr_scale", "lr_factor", "build_schedule", "warmup_linear_scaling"]


def lr_scale(global_batch: int, base_batch: int | None) -> float:
    return 1.0 if base_batch is None else global_batch / base_batch


def lr_factor(step: int, *, schedule: str = "constant", total_steps: int = 1, warmup_steps: int = 0,
              step_size: int = 1, gamma: float = 0.1, min_lr_ratio: float = 0.0) -> float:
    """The lr multiplier for optimizer step ``step`` (0-based), before linear scaling.

    Warmup ramps linearly from ``1/warmup_steps`` to 1 over the first ``warmup_steps`` steps.
    After it, ``cosine`` and ``linear`` decay from 1 to ``min_lr_ratio`` at ``total_steps``,
    ``step`` multiplies by ``gamma`` every ``step_size`` steps, ``constant`` stays at 1.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "step":
        return gamma ** ((step - warmup_steps) // step_size)
    if schedule in ("cosine", "linear"):
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return min_lr_ratio + (1 - min_lr_ratio) * shape
    return 1.0


def build_schedule(optimizer: torch.optim.Optimizer, *, schedule: str = "constant", total_steps: int = 1,
                   warmup_steps: int = 0, global_batch: int = 1, base_batch: int | None = None,
                   step_size: int = 1, gamma: float = 0.1, min_lr_ratio: float = 0.0) -> LambdaLR | None:
    """The configured schedule on ``optimizer``, or ``None`` when the lr is constant and unscaled."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is unknown: use one of {', '.join(SCHEDULES)}")
    scale = lr_scale(global_batch, base_batch)
    if schedule == "constant" and not warmup_steps and scale == 1.0:
        return None
    options = dict(schedule=schedule, total_steps=total_steps, warmup_steps=warmup_steps, step_size=step_size,
                   gamma=gamma, min_lr_ratio=min_lr_ratio)
    return LambdaLR(optimizer, lambda step: _scaled(step, scale, warmup_steps, lr_factor(step, **options)))  # type: ignore[arg-type]


def _scaled(step: int, scale: float, warmup_steps: int, factor: float) -> float:
    """``scale * factor``; but while an lr scaled up (``scale > 1``) warms up, Goyal et al.'s
    gradual warmup: from the base lr at step 0 up by a constant amount per step, to ``scale`` x
    the base lr at ``warmup_steps``. An unscaled (or scaled-down) lr warms up from
    ``1/warmup_steps`` of itself, as :func:`lr_factor` says."""
    if scale > 1 and step < warmup_steps:
        return 1 + (scale - 1) * step / warmup_steps
    return scale * factor


def warmup_linear_scaling(
    optimizer: torch.optim.Optimizer, global_batch: int, base_batch: int | None = None, warmup_steps: int = 0
) -> LambdaLR:
    """Multiply every group's lr by ``k = global_batch/base_batch``, ramped linearly over ``warmup_steps``.

    With ``k > 1`` the warmup is Goyal et al.'s: the base lr at step 0, ``k`` x it from
    ``warmup_steps`` on, a constant increase per step between. Otherwise it goes from
    ``1/warmup_steps`` of the target up to it. With no warmup the scaled lr applies from the first step.
    """
    scale = lr_scale(global_batch, base_batch)
    return LambdaLR(optimizer, lambda step: _scaled(step, scale, warmup_steps, lr_factor(step, warmup_steps=warmup_steps)))
