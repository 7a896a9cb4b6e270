"""Mixed precision: autocast to fp16/bf16, with loss scaling for fp16 (torch.amp's autocast and GradScaler)."""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, ContextManager

import torch

from ..dtensors import is_dtensor, local_part
from .base import Precision, Stepped

__all__ = ["FP16Mixed", "BF16Mixed", "all_finite"]


def all_finite(grads: list[torch.Tensor]) -> bool:
    """Whether every gradient is finite, the same answer on every rank.

    One fused reduction instead of a host sync per tensor, on one device (``devices`` puts the
    parts on several). DDP's gradients are already all-reduced, so every rank sees the same
    values; a sharded (DTensor) gradient is checked on this rank's shard and the verdict
    all-reduced over the job, else the rank holding an inf would skip the step alone.
    """
    if not grads:
        return True
    sharded = any(is_dtensor(g) for g in grads)
    local = [local_part(g) for g in grads]
    device = local[0].device
    ok = torch.stack([torch.isfinite(g).all().to(device) for g in local]).all().to(torch.int32)
    if sharded and torch.distributed.is_initialized():
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    return bool(ok)


class BF16Mixed(Precision):
    """Autocast to bfloat16; fp32 weights and optimizer. bf16's range makes loss scaling unneeded."""

    name = "bf16-mixed"
    dtype = torch.bfloat16
    autocast = True
    param_dtype = torch.bfloat16
    reduce_dtype: ClassVar[torch.dtype | None] = torch.float32  # fp32 reductions of low-precision compute (FSDP2's policy)
    bench_default = "quick"

    def forward_context(self) -> ContextManager[Any]:
        return torch.autocast(self.device.type, dtype=self.dtype)


class FP16Mixed(BF16Mixed):
    """Autocast to float16 with loss scaling.

    * ``loss_scale=None``: a dynamic :class:`torch.amp.GradScaler` (starts at 2**16, halves on
      overflow, doubles after 2000 clean steps).
    * ``loss_scale=128.0`` (Apex's ``static_loss_scale``): a fixed scale; a step whose
      unscaled gradients contain inf/NaN is skipped and the scale stays put.

    Either way a skipped step is counted in :attr:`skipped_steps`.
    """

    name = "fp16-mixed"
    dtype = torch.float16
    param_dtype = torch.float16
    scales_loss = True
    bench_default = "full"
    _skipped: int = 0
    _skips_on_device: torch.Tensor | None = None  # skips a fused optimizer's steps counted on the device, not read yet

    def __init__(self, device: torch.device, loss_scale: float | None = None) -> None:
        super().__init__(device)
        if loss_scale is not None and not (loss_scale > 0 and math.isfinite(loss_scale)):
            raise ValueError(f"loss scale {loss_scale} must be a positive finite number, or None for dynamic")
        self.static_scale: float = 1.0 if loss_scale is None else loss_scale  # used only without a scaler
        self.scaler = None if loss_scale is not None else torch.amp.GradScaler(device.type)

    @property  # type: ignore[override]
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN gradients (reading it waits for the device when a fused
        optimizer's steps are still counted there)."""
        if self._skips_on_device is not None:
            self._skipped += int(self._skips_on_device.item())
            self._skips_on_device = None
        return self._skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped, self._skips_on_device = int(value), None

    @property
    def loss_scale(self) -> float:
        return self.static_scale if self.scaler is None else float(self.scaler.get_scale())

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            (loss * self.static_scale).backward()

    def step(self, optimizer: torch.optim.Optimizer, clip: Callable[[], Any] | None = None) -> bool | Stepped:
        if self.scaler is None:
            return self._static_step(optimizer, clip)
        self.scaler.unscale_(optimizer)  # so clipping sees true gradient norms
        if clip is not None:
            clip()
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._device_step(optimizer)
        # One wait for the device a step, as in PyTorch's AMP recipe: whether unscale_ found inf/NaN.
        # scaler.step reads the same flags next (nothing queued since: no wait) and skips exactly
        # then; update() adjusts the scale on the device. Comparing get_scale() before and after
        # instead would wait twice more, the second time for the whole optimizer step.
        found = self.scaler._found_inf_per_device(optimizer)
        skipped = any(bool(flag.item()) for flag in found.values())
        self.scaler.step(optimizer)
        self.scaler.update()
        self.skipped_steps += int(skipped)
        return not skipped

    def _device_step(self, optimizer: torch.optim.Optimizer) -> Stepped:
        """The step of an optimizer that reads GradScaler's inf flag itself (``AdamW(fused=True)``...): its kernel
        skips an overflowed step on the device, so nothing here waits for the device (PyTorch's AMP loop with such
        an optimizer does not either: a wait a step cost GPT-2 124M 4.5% of its tokens/s on an H200). The skip is
        counted on the device; :attr:`skipped_steps` and the returned :class:`Stepped` read it when asked."""
        found = self.scaler._found_inf_per_device(optimizer)  # type: ignore[union-attr]
        flag = torch.stack([f.to(self.device) for f in found.values()]).sum() if found else torch.zeros((), device=self.device)
        self.scaler.step(optimizer)  # type: ignore[union-attr]
        self.scaler.update()  # type: ignore[union-attr]
        self._skips_on_device = flag if self._skips_on_device is None else self._skips_on_device + flag
        return Stepped(flag)

    def _static_step(self, optimizer: torch.optim.Optimizer, clip: Callable[[], Any] | None) -> bool:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        inv = 1.0 / self.static_scale
        for g in grads:
            g.mul_(inv)
        finite = all_finite(grads)
        if not finite:
            self.skipped_steps += 1
            return False
        if clip is not None:
            clip()
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
