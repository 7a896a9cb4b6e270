"""The precision interface, and plain fp32 (``"32"``) / TF32 (``"tf32"``)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, ContextManager, Iterable, TypeVar

import torch
from torch import nn

__all__ = ["Precision", "FP32", "TF32", "Stepped", "fp32_loss", "computes_in_fp32"]

_FP32_LOSSES: set[Callable[..., Any]] = {nn.functional.cross_entropy}


LossFn = TypeVar("LossFn", bound=Callable[..., Any])


def fp32_loss(fn: LossFn) -> LossFn:
    """Mark ``fn`` as a loss made only of ops that autocast computes in fp32 (cross-entropy is one): the
    built-in step runs it under the precision's autocast, which reads low-precision logits straight into
    fp32 instead of taking an fp32 copy of them first (the same loss)."""
    _FP32_LOSSES.add(fn)
    return fn


def computes_in_fp32(loss_fn: Callable[..., Any]) -> bool:
    """Is ``loss_fn`` ``F.cross_entropy`` or marked by :func:`fp32_loss`?"""
    try:
        return loss_fn in _FP32_LOSSES
    except TypeError:  # an unhashable callable
        return False


class Stepped:
    """Whether an optimizer step changed the weights, read from the device only when asked (``bool(it)``).

    fp16-mixed with an optimizer that skips an overflowed step on the device itself (``AdamW(fused=True)``,
    as ``torch.amp.GradScaler`` drives it) returns this instead of a ``bool``: the step does not wait for the
    device to learn whether the gradients overflowed, as PyTorch's own AMP loop does not. It compares equal
    to the ``bool`` it stands for."""

    __slots__ = ("_found", "_value")

    def __init__(self, found: torch.Tensor) -> None:
        self._found = found  # non-zero: inf/NaN gradients, the step was skipped
        self._value: bool | None = None

    def __bool__(self) -> bool:
        if self._value is None:
            self._value = not bool(self._found.item())
        return self._value

    def __eq__(self, other: object) -> bool:
        return bool(self) == bool(other) if isinstance(other, (bool, Stepped)) else NotImplemented

    def __hash__(self) -> int:
        return hash(bool(self))

    def __repr__(self) -> str:
        return repr(bool(self))


class Precision:
    """How forward runs (autocast) and how a loss becomes an optimizer step (loss scaling).

    ``skipped_steps`` counts optimizer steps skipped because gradients overflowed (fp16 only).
    The class-level facts below are what a strategy, the config and bench ask of a precision:
    code outside ``precision/`` never compares its name or class
    (``tests/strategies/test_strategy_facts.py`` scans for that).
    """

    name = "32"
    autocast = False  # True when forward runs under torch.autocast
    master_weights: ClassVar[bool] = False  # low-precision model weights, fp32 masters in the optimizer
    scales_loss: ClassVar[bool] = False  # the loss is scaled and a step whose gradients overflow is skipped (fp16)
    param_dtype: ClassVar[torch.dtype | None] = None  # the dtype the parameters compute in (None: their own)
    reduce_dtype: ClassVar[torch.dtype | None] = None  # the dtype sharded gradients are reduced in (None: theirs)
    float8: ClassVar[bool] = False  # replaces the model's nn.Linear layers with torchao's Float8Linear (fp8-mixed)
    reference: ClassVar[bool] = False  # full fp32: the precision every other one is checked against
    bench_default: ClassVar[str] = "no"  # in paratrain bench's default matrices: "quick" (and full), "full", "no"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.skipped_steps = 0

    @classmethod
    def unsupported(cls, device: torch.device) -> str | None:
        """Why this precision cannot run on ``device`` here (one line that says what to use), or None.
        Asked before any worker starts (bench's and selftest's cells skip with it)."""
        return None

    def setup_model(self, model: nn.Module) -> nn.Module:
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def sync_from_model(self) -> None:
        """The user loaded new weights into the set-up model: refresh any copy of them (masters)."""

    def checkpoint_loaded(self) -> None:
        """The model holds a checkpoint's weights now (loaded after :meth:`load_state_dict`)."""

    def broadcast(self) -> None:
        """After the strategy placed the model (which now holds rank 0's weights): make what this
        precision keeps beside the model rank 0's too (the masters)."""

    def clip_targets(self, models: Iterable[nn.Module]) -> list[list[torch.Tensor]]:
        """The parameter lists whose gradient norm ``clip_grad_norm`` bounds, each on its own:
        every model's parameters (the fp32 masters under master weights)."""
        return [list(m.parameters()) for m in models]

    def forward_context(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer, clip: Callable[[], Any] | None = None) -> bool | Stepped:
        """Clip (if asked) and step. Returns False (or a :class:`Stepped` that is) when the step was skipped."""
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
    reference = True
    bench_default = "quick"

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
