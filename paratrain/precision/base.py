"""The precision interface, and plain fp32 (``"32"``) / TF32 (``"tf32"``)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
from torch import nn

__all__ = ["Precision", "FP32", "TF32"]


class Precision:
    """How forward runs (autocast) and how a loss becomes an optimizer step (loss scaling).

    ``skipped_steps`` counts optimizer steps skipped because gradients overflowed (fp16 only).
    """

    name = "32"
    autocast = False  # True when forward runs under torch.autocast
    max_grad_norm: float | None = None  # set by Parallel (clip_grad_norm)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.skipped_steps = 0

    def setup_model(self, model: nn.Module) -> nn.Module:
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def sync_from_model(self) -> None:
        """The user loaded new weights into the set-up model: refresh any copy of them (masters)."""

    def forward_context(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer, clip: Callable[[], Any] | None = None) -> bool:
        """Clip (if asked) and step. Returns False when the step was skipped."""
        if clip is not None:
            clip()
        optimizer.step()
        return True

    @property
    def loss_scale(self) -> float:
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))


class FP32(Precision):
    """Full fp32, with TF32 matmuls switched *off* so results do not depend on the GPU model."""

    name = "32"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


class TF32(Precision):
    """fp32 weights with TF32 tensor-core matmuls and convolutions on Ampere+ GPUs (a no-op on CPU)."""

    name = "tf32"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
