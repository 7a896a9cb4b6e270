"""Stop a run whose loss stays NaN or inf, before it writes a checkpoint of a broken model."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..dtensors import local_part
from ..parallel import Parallel

__all__ = ["NonFiniteLossError", "LossWindow"]

_FIXES = "lower --lr, clip gradients (--clip-grad-norm 1.0), or train in bf16-mixed or 32 instead of fp16"


class NonFiniteLossError(ValueError):
    """The loss stayed NaN/inf, or the weights became NaN/inf: a setting to change, told in one line."""


class LossWindow:
    """The loss of every optimizer step since the last log line, kept on the device (no host sync
    per step), and the stop rule: ``limit`` consecutive steps whose loss, averaged over the
    data-parallel ranks, is NaN or inf end the run with :class:`NonFiniteLossError`.

    The rule is checked where the window is reduced anyway (every log line) and before every
    checkpoint, so a checkpoint is never written after a NaN: a step whose loss is not finite is
    not checkpointed, and non-finite weights stop the run at once. An fp16 step that the
    GradScaler skips for overflowing gradients has a finite loss and does not count.
    """

    def __init__(self, pt: Parallel, size: int, limit: int, checkpoints: bool = False) -> None:
        self.pt, self.limit, self.checkpoints = pt, limit, checkpoints
        self.losses = torch.zeros(size, device=pt.device)
        self.start = pt.global_step  # the step before the window's first one
        self.checked = 0  # steps of the window already checked
        self.streak, self.since, self.last = 0, 0, math.nan  # non-finite steps in a row, the first, its loss
        self._hit: tuple[int, int, float] | None = None  # a streak that reached the limit: since, length, loss

    def add(self, loss: torch.Tensor) -> None:
        """Add one micro-batch's loss to the current optimizer step's."""
        self.losses[self.pt.global_step - self.start] += loss.detach()

    def mean(self) -> float:
        """Mean micro-batch loss over the window and the ranks (collective); starts a new window.
        Call :meth:`check` after logging it."""
        n = self.pt.global_step - self.start
        values = self.pt.all_reduce_mean(self.losses[:n]).tolist()
        self._scan(values[self.checked:], self.start + self.checked)
        self.losses.zero_()
        self.start, self.checked = self.pt.global_step, 0
        return sum(values) / (n * self.pt.accumulation)

    def check(self) -> None:
        """Raise :class:`NonFiniteLossError` if the steps seen so far meet the stop rule."""
        if self._hit is None:
            return
        since, length, loss = self._hit
        kept = f"no checkpoint was written after step {since - 1}" if self.checkpoints else "no checkpoint was written"
        raise NonFiniteLossError(
            f"training stopped at step {self.pt.global_step}: the loss was {loss} for {length} optimizer steps in a "
            f"row since step {since} (max_nonfinite_steps={self.limit}); {kept}: {_FIXES}")

    def safe_to_save(self, model: torch.nn.Module) -> bool:
        """Before a checkpoint (collective): raise when the rule is met or the weights are not
        finite; False when the latest step's loss is not finite (skip this checkpoint)."""
        if not self._finite(model):
            self.pt.print(f"paratrain: step {self.pt.global_step}: loss {self.last}, checkpoint not written")
            return False
        return True

    def finish(self, model: torch.nn.Module) -> None:
        """At the end of training (collective): a model whose last loss is not finite is no result."""
        if not self._finite(model):
            raise NonFiniteLossError(f"training ended at step {self.pt.global_step} with loss {self.last} "
                                     f"(not finite since step {self.since}; max_nonfinite_steps={self.limit}): "
                                     f"{_FIXES}")

    def _finite(self, model: torch.nn.Module) -> bool:
        """Check the steps not checked yet and the weights on every rank; is the latest loss finite?"""
        n = self.pt.global_step - self.start
        if n > self.checked:
            self._scan(self.pt.all_reduce_mean(self.losses[self.checked:n]).tolist(), self.start + self.checked)
            self.checked = n
        self.check()
        local = [local_part(p) for p in model.parameters()]
        if self.pt.any_rank(~torch.isfinite(torch.nn.utils.get_total_norm(local, norm_type=math.inf))):
            raise NonFiniteLossError(f"training stopped at step {self.pt.global_step}: the model's weights are NaN "
                                     f"or inf (no checkpoint was written with them): {_FIXES}")
        return self.streak == 0

    def _scan(self, values: list[Any], start: int) -> None:
        """Follow the run of non-finite losses over ``values``, the losses of steps ``start + 1``..."""
        for i, value in enumerate(values):
            if math.isfinite(value):
                self.streak = 0
                continue
            self.streak += 1
            self.last = value
            if self.streak == 1:
                self.since = start + i + 1
            if self.streak >= self.limit and (self._hit is None or self._hit[0] == self.since):
                self._hit = (self.since, self.streak, value)  # the first such run, to its end
