"""Low-precision weights with fp32 master weights: ``bf16-true`` and ``fp16-true`` (Apex ``O2``/``O3``).

The model's floating parameters and buffers are cast to bf16/fp16 in place, forward runs in that
dtype (under autocast, which also casts the inputs), and backward produces low-precision
gradients. The optimizer never sees the low-precision weights: :meth:`MasterWeights.setup_optimizer`
puts an fp32 *master* copy of each parameter in its place in the optimizer's param groups. At
each step the gradients are copied to the masters in fp32, clipping (and for fp16 the loss
scaler's unscale and overflow check) runs on them, the optimizer steps the masters, and the new
masters are rounded back into the model. Updates smaller than the low-precision resolution
therefore accumulate in the masters instead of vanishing, and the optimizer state (momentum,
Adam moments) is fp32. The model's parameters themselves are never swapped, so DDP's gradient
hooks on them keep working.

The masters are part of :meth:`state_dict` (and so of paratrain checkpoints): a resumed run
continues from the same fp32 values, not from their rounded copies.

Supported with ``single``, ``dp``, ``ddp`` and ``devices`` (whose parameters are plain tensors on
every rank). ``fsdp``/``tensor`` already keep fp32 sharded masters and compute in low precision
with ``bf16-mixed``/``fp16-mixed`` (FSDP2's ``MixedPrecisionPolicy``); ``pipeline`` and ``ps`` are
refused as well (one line, at config time).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable

import torch
from torch import nn

from .amp import BF16Mixed, FP16Mixed

__all__ = ["BF16True", "FP16True", "MasterWeights"]


class MasterWeights:
    """fp32 master copies of a model's low-precision parameters, stepped by the optimizer.

    A mixin placed before a mixed precision (``BF16Mixed``/``FP16Mixed``), whose autocast,
    backward and step (loss scaling) it keeps, applied to the masters."""

    dtype: torch.dtype
    master_weights: ClassVar[bool] = True
    reduce_dtype: ClassVar[torch.dtype | None] = None  # DDP reduces the low-precision gradients as they are
    bench_default: ClassVar[str] = "no"

    def _init_masters(self) -> None:
        self._pairs: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}  # id(param) -> (param, master)
        self._names: list[str] = []  # the parameters' names in the model, in _pairs' order (for export)
        self._masters_from_model = False  # see load_state_dict

    def setup_model(self, model: nn.Module) -> nn.Module:
        for name, p in model.named_parameters():
            if p.is_floating_point() and id(p) not in self._pairs:
                self._pairs[id(p)] = (p, nn.Parameter(p.detach().to(torch.float32, copy=True)))
                self._names.append(name)
        model.to(self.dtype)  # in place: the parameters keep their identity
        return model

    def broadcast(self) -> None:
        """Rank 0's masters on every rank, as DDP broadcasts rank 0's weights into the model: a model
        each rank initialised differently would otherwise step from its own masters."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        for p, m in self._pairs.values():
            if m.device != p.device:
                m.data = m.data.to(p.device)
            dist.broadcast(m.data, src=0)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Put each parameter's fp32 master in its place in ``optimizer``'s param groups (on the
        parameter's device: the strategy has placed the model by now)."""
        for p, m in self._pairs.values():
            if m.device != p.device:
                m.data = m.data.to(p.device)
        for group in optimizer.param_groups:
            group["params"] = [self._pairs[id(p)][1] if id(p) in self._pairs else p for p in group["params"]]
        for p in [p for p in optimizer.state if id(p) in self._pairs]:  # an optimizer that already stepped
            optimizer.state[self._pairs[id(p)][1]] = optimizer.state.pop(p)
        return optimizer

    def clip_targets(self, models: Iterable[nn.Module]) -> list[list[torch.Tensor]]:
        """The fp32 masters, all together: clipping applies to their (fp32) gradients."""
        return [[m for _, m in self._pairs.values() if m.grad is not None]]

    def step(self, optimizer: torch.optim.Optimizer, clip: Callable[[], Any] | None = None) -> bool:
        """Gradients to the masters (fp32; the model's are cleared), the mixed precision's step on
        them (``clip`` then clips the masters: :meth:`clip_targets`), masters back into the model
        (rounded)."""
        for p, m in self._pairs.values():
            # one parameter at a time, its low-precision gradient freed once copied (DDP's bucket
            # views aside): the step holds the fp32 master gradients, not both (2 bytes a parameter)
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None
        try:
            return super().step(optimizer, clip)  # type: ignore[misc]
        finally:
            with torch.no_grad():
                for p, m in self._pairs.values():
                    p.copy_(m)
                    m.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "masters": self.masters_state(),  # type: ignore[misc]
                "master_names": list(self._names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # type: ignore[misc]
        self.load_masters(state.get("masters"))
        # Written in a precision without fp32 masters (32, *-mixed) and resumed here: the masters must
        # start from the loaded weights, which the model gets after this (checkpoint_loaded).
        self._masters_from_model = "masters" not in state

    def checkpoint_loaded(self) -> None:
        if self._masters_from_model:
            self.sync_from_model()
        self._masters_from_model = False

    def sync_from_model(self) -> None:
        """The user loaded new weights into the model: the masters start from them."""
        self.load_masters(None)

    def masters_state(self) -> list[torch.Tensor]:
        return [m.detach().cpu().clone() for _, m in self._pairs.values()]

    def load_masters(self, masters: list[torch.Tensor] | None) -> None:
        """Restore saved masters (in parameter order); without them, start from the model's values."""
        pairs = list(self._pairs.values())
        if masters is None:
            masters = [p.detach() for p, _ in pairs]  # the model's (rounded) values
        if len(masters) != len(pairs):
            raise ValueError(f"checkpoint holds {len(masters)} master weights but the model has {len(pairs)} "
                             "floating parameters: load it into the same model")
        with torch.no_grad():
            for (_, m), value in zip(pairs, masters):
                m.copy_(value)


class BF16True(MasterWeights, BF16Mixed):
    """bf16 weights, activations and gradients; fp32 master weights and optimizer state."""

    name = "bf16-true"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._init_masters()


class FP16True(MasterWeights, FP16Mixed):
    """fp16 weights, activations and gradients; fp32 master weights; loss scaling (Apex ``O2``).

    The scaler unscales and checks the fp32 copies of the gradients, so an overflowing step is
    skipped (and counted) exactly as with ``fp16-mixed``.
    """

    name = "fp16-true"

    def __init__(self, device: torch.device, loss_scale: float | None = None) -> None:
        super().__init__(device, loss_scale)
        self._init_masters()
