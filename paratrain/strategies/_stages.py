"""A pipeline rank's stage at run time (:mod:`paratrain.strategies.pipeline`): its layers under the
precision's autocast, and the ``torch.distributed.pipelining`` stage and schedule that run it for a
step or an evaluation."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
from torch import nn

from ._split import check_sequential

if TYPE_CHECKING:
    from .pipeline import PipelineOptions

__all__ = ["PipelineModule"]


class _StageForward(nn.Module):
    """What ``PipelineStage`` runs: the stage's layers, under the precision's autocast."""

    def __init__(self, part: nn.Module) -> None:
        super().__init__()
        self.part = part
        self.context: Callable[[], Any] = contextlib.nullcontext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.context():
            return self.part(x)


class PipelineModule(nn.Module):
    """This rank's stage: ``module`` holds its layers (the user's own modules, shared).

    It cannot run the model alone: train with ``pt.training_step`` and evaluate with
    ``pt.evaluate``. One ``PipelineStage`` + schedule is kept per batch shape, because a stage
    infers its send/receive buffers once; a later batch of another size would be received into
    the old buffers (silently wrong on gloo in torch 2.13).
    """

    module: nn.Module
    stage: "_StageForward"
    original: nn.Module
    parts: Sequence[nn.Module]

    def __init__(self, parts: Sequence[nn.Module], index: int, original: nn.Module, device: torch.device,
                 options: PipelineOptions, distributed: bool, group: Any = None) -> None:
        super().__init__()
        self.module = parts[index]
        # Not submodules (no duplicate parameters): the stage's runner, the whole model, all parts.
        object.__setattr__(self, "stage", _StageForward(self.module))
        object.__setattr__(self, "original", original)
        object.__setattr__(self, "parts", parts)
        self.index, self.n_stages, self.device, self.options = index, len(parts), device, options
        self.distributed = distributed  # False: a world of one, no process group: plain micro-batching
        self.group = group  # the stages' process group (None: every rank is a stage of one pipeline)
        # pipelines side by side shard a stage over its replicas (FSDP2): every replica's stage must run as many
        # forwards, but the replicas' evaluation batches differ in size (the last one, padding): one chunk each
        self.eval_whole = False
        self._schedules: dict[tuple, Any] = {}
        self._loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._checked = False

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "pipeline: one stage cannot run the model alone: train with pt.training_step(model, (x, y), loss_fn) "
            "and evaluate with pt.evaluate(model, loader)"
        )

    def check(self, x: torch.Tensor) -> None:
        """Once: the stages run in order must compute the model's own forward (skipped unless the
        whole model sits on ``x``'s device, i.e. on CPU, since only this stage was moved)."""
        if self._checked:
            return
        self._checked = True
        if all(p.device == x.device for p in self.original.parameters()):
            check_sequential(self.original, self.parts, x, "pipeline")

    def _schedule(self, shape: torch.Size, n: int, training: bool) -> Any:
        key = (tuple(shape), n, training)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            stage = PipelineStage(self.stage, self.index, self.n_stages, self.device, group=self.group)
            cls = Schedule1F1B if training and self.options.schedule == "1f1b" else ScheduleGPipe
            loss_fn = self._micro_loss if training else None
            self._schedules[key] = cls(stage, n, loss_fn=loss_fn, scale_grads=False)
        return self._schedules[key]

    def _micro_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss(out, target)  # type: ignore[misc]

    def train_step(self, x: torch.Tensor, y: torch.Tensor, n: int,
                   loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """Forward and backward of ``n`` micro-batches; ``loss`` runs on the last stage, which
        returns the ``n`` losses (other stages: an empty list)."""
        losses: list[torch.Tensor] = []
        if not self.distributed:
            for xc, yc in zip(x.chunk(n), y.chunk(n)):
                losses.append(loss(self.stage(xc), yc))
                losses[-1].backward()
        else:
            # The schedule's ``losses``, not our own record of loss_fn calls: in torch 2.13 the
            # first step of a schedule also calls loss_fn once to infer gradient shapes.
            self._loss = loss
            schedule = self._schedule(x.shape, n, training=True)
            shared: list[Any] = getattr(self.module, "shared_grads", list)()  # a tied weight's gradient before this backward
            schedule.step(*((x,) if self.is_first else ()), target=y if self.is_last else None,
                          losses=losses if self.is_last else None, return_outputs=False)
            if shared:
                cast(Any, self.module).sync_shared(shared)  # summed with the other stage holding it (GPT-2's tied embedding)
        return [t.detach() for t in losses]

    def eval_step(self, x: torch.Tensor) -> torch.Tensor | None:
        """Forward only; the model's output on the last stage, ``None`` elsewhere."""
        if not self.distributed:
            return self.stage(x)
        n = self.options.n_microbatches if len(x) % self.options.n_microbatches == 0 and not self.eval_whole else 1
        out = self._schedule(x.shape, n, training=False).eval(*((x,) if self.is_first else ()))
        return out if self.is_last else None
