"""A pipeline's stages (:mod:`paratrain.strategies.pipeline`): its settings and schedules, the one rule that cuts a
model into stages and the one that places them on ranks, and a rank's stage at run time: its layers under the
precision's autocast, and the ``torch.distributed.pipelining`` stage and schedule that run it for a step or an
evaluation."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, cast

import torch
from torch import nn

from ._split import check_sequential, parse_split_points, split_model
from ._stack import split_stack
from .base import NotApplicable

__all__ = ["PipelineModule", "PipelineOptions", "SCHEDULE_CLASSES", "SCHEDULES", "LOOPED", "V_SHAPED", "SPLIT_BACKWARD",
           "cut_stages", "check_positions", "stage_ranks"]

SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B",
                    "loopedbfs": "ScheduleLoopedBFS", "interleavedzerobubble": "ScheduleInterleavedZeroBubble",
                    "zbvzerobubble": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
"""Each schedule's class in ``torch.distributed.pipelining``; a schedule is named as its class (any case, with or
without ``Schedule``), as torchtitan names them."""
LOOPED = ("interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev")
"""The schedules that run several stages a rank (:func:`stage_ranks` says which rank holds which)."""
V_SHAPED = ("zbvzerobubble", "dualpipev")
"""The schedules whose two stages a rank sit in a V: rank ``q`` of ``pp`` holds stages ``q`` and ``2 pp - 1 - q`` (the
first and the last stage on rank 0); the other looped ones loop: stage ``s`` on rank ``s % pp``."""
SPLIT_BACKWARD = ("interleavedzerobubble", "zbvzerobubble", "dualpipev")
"""The zero-bubble schedules: a micro-batch's backward is two actions, its input gradients first and its weight
gradients later, with other micro-batches' forwards between them."""


def cut_stages(model: nn.Module, n_stages: int, rank: int = 0, split_points: Sequence[str] = (),
               distributed: bool = False, replicas: int = 1, replica: int = 0,
               placement: Sequence[int] | None = None) -> list[nn.Module]:
    """The pipeline's one rule for cutting ``model`` into ``n_stages`` stages: its top-level
    children in consecutive runs (``split_model``: at ``split_points``, or balanced by parameter
    count), or, for a model whose children are no sequence (a GPT, Llama: a stack of blocks),
    between its blocks (``split_stack``; with ``distributed``, a collective that makes the groups
    of tied parameters, ``rank``'s included; ``replicas`` pipelines side by side, this one
    ``replica``; stage ``s`` on pipeline rank ``placement[s]``). ``NotApplicable`` when neither cuts it. The
    strategy's setup and the memory estimate (:mod:`paratrain.bench.memory`) both cut here."""
    try:
        return list(split_model(model, n_stages, split_points, "pipeline"))
    except NotApplicable:
        stacked = split_stack(model, n_stages, rank, split_points, distributed, replicas, replica, placement)
        if stacked is None:
            raise
        return list(stacked)


def check_positions(out: torch.Tensor, target: torch.Tensor, model: str) -> None:
    """Refuse, in one line, a model whose output covers fewer positions than its targets: nanoGPT's
    ``GPT.forward(idx)`` without targets returns only the last position's logits (an inference
    shortcut), which the pipeline's loss cannot compare with a target per position."""
    if isinstance(out, torch.Tensor) and out.dim() == target.dim() + 1 and out.shape[0] == target.shape[0] \
            and out.shape[1:-1] != target.shape[1:]:
        raise NotApplicable(
            f"pipeline: {model} returned outputs of shape {tuple(out.shape)} for targets of shape "
            f"{tuple(target.shape)}: it gives fewer positions than there are targets (nanoGPT's forward returns only "
            "the last position's logits when called without targets); the pipeline calls model(x) and computes the "
            "loss itself, so make forward return every position's logits when targets is None")


SCHEDULES = tuple(SCHEDULE_CLASSES)


@dataclass(kw_only=True)
class PipelineOptions:
    """Pipeline settings."""

    schedule: str = "gpipe"
    """gpipe (all forwards, then all backwards), 1f1b (steady state alternates: less activation memory), or, with
    several stages a rank (``stages_per_rank``, a smaller bubble): interleaved1f1b, loopedbfs, or
    interleavedzerobubble (the weights' backward fills the bubble); with exactly 2 stages a rank in a V (rank ``q``
    holds stages ``q`` and ``2 pp - 1 - q``): zbvzerobubble or dualpipev."""
    n_microbatches: int = 4
    """Micro-batches each step's batch is cut into; the batch must be divisible by it."""
    stages_per_rank: int = 0
    """Stages each pipeline rank holds (the model is cut into ``pp * stages_per_rank``; rank ``q`` holds stages
    ``q``, ``q + pp``, ..., or ``q`` and ``2 pp - 1 - q`` under the V-shaped schedules, which take only 2). 0: 2 for
    the schedules of several stages a rank, 1 for gpipe and 1f1b (which take only 1)."""
    split_points: list[str] = field(default_factory=list)
    """Top-level children that start stages 2..N (e.g. ["4"] in an nn.Sequential).
    Empty: contiguous stages with parameter counts as even as possible."""

    def __post_init__(self) -> None:
        self.schedule = str(self.schedule).lower().removeprefix("schedule").replace("_", "")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {self.schedule!r} is unknown: use one of {', '.join(SCHEDULES)}")
        looped = self.schedule in LOOPED
        self.stages_per_rank = self.stages_per_rank or (2 if looped else 1)
        if self.schedule in V_SHAPED and self.stages_per_rank != 2:
            raise ValueError(f"pipeline stages_per_rank={self.stages_per_rank} with schedule {self.schedule}: it "
                             "places exactly 2 stages a rank, in a V: set stages_per_rank 2 (or leave it 0), or use "
                             "interleaved1f1b for more")
        if self.stages_per_rank < 1 or (not looped and self.stages_per_rank != 1):
            raise ValueError(f"pipeline stages_per_rank={self.stages_per_rank} with schedule {self.schedule}: "
                             + (f"use one of {', '.join(LOOPED)} for several stages a rank" if self.stages_per_rank > 1
                                else "it must be at least 1"))
        if self.n_microbatches < 1:
            raise ValueError(f"pipeline n_microbatches {self.n_microbatches} must be at least 1")
        self.split_points = parse_split_points(self.split_points, "pipeline")


def stage_ranks(schedule: str, pp: int, n_stages: int) -> list[int]:
    """The pipeline rank that holds each of the ``n_stages`` stages under ``schedule``: torch's own placement
    (``generate_stage_to_rank_mapping``, which its schedules use), V-shaped or looped."""
    if n_stages == pp:
        return list(range(pp))
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    mapping = generate_stage_to_rank_mapping(pp, n_stages, style="v" if schedule in V_SHAPED else "loop")
    return [mapping[s] for s in range(n_stages)]


def _forward_only_v(pipelining: Any) -> Any:
    """An evaluation's schedule for stages placed in a V: forwards only, each rank's stages in stage order, every
    micro-batch. ZBV's and DualPipeV's own schedules run their backward actions even in ``eval()`` (and fail on
    them), and LoopedBFS, the looped schedules' evaluation, places stages in a loop. Torch's runtime runs it and
    adds the sends and receives; only its check that every forward has a backward (a training plan's) is left out."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _Action, _ComputationType

    def placed(pp: int, n_stages: int) -> dict[int, int]:
        return dict(enumerate(stage_ranks(V_SHAPED[0], pp, n_stages)))

    class _VPlacement(PipelineScheduleMulti):
        def _validate_and_set_stage_mapping(self, actions: Any) -> None:  # the runtime's lowering calls it first
            self.stage_index_to_group_rank = placed(self.pp_group_size, self._num_stages)
            for stage in self._stages:
                stage.stage_index_to_group_rank = self.stage_index_to_group_rank

    # LoopedBFS's runtime, then _VPlacement before PipelineScheduleMulti in the method order
    class ScheduleForwardOnlyV(pipelining.ScheduleLoopedBFS, _VPlacement):
        def _calculate_single_rank_operations(self, rank: int) -> list[Any]:
            mine = sorted(s for s, q in placed(self.pp_group_size, self._num_stages).items() if q == rank)
            return [_Action(s, _ComputationType.FORWARD, mb) for s in mine for mb in range(self._n_microbatches)]

    return ScheduleForwardOnlyV


class _StageForward(nn.Module):
    """What ``PipelineStage`` runs: the stage's layers, under the precision's autocast."""

    def __init__(self, part: nn.Module) -> None:
        super().__init__()
        self.part = part
        self.context: Callable[[], Any] = contextlib.nullcontext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.context():
            return self.part(x)


def _holding(model: nn.Module, stages: Sequence[nn.Module]) -> nn.Module:
    """One module holding ``stages`` (a rank's several) at the model's own paths: its ``state_dict`` keys
    are the model's, as one stage's are."""
    from ._stack import StackStage, _mirror

    names: list[str] = []
    for stage in stages:
        names += stage._owned if isinstance(stage, StackStage) else list(stage._modules)  # Sequential: top-level
    return _mirror(model, names)


class PipelineModule(nn.Module):
    """This rank's stage: ``module`` holds its layers (the user's own modules, shared); with several
    stages a rank (the interleaved schedules), ``local`` are they and ``module`` holds them all.

    It cannot run the model alone: train with ``pt.training_step`` and evaluate with
    ``pt.evaluate``. One ``PipelineStage`` + schedule is kept per batch shape, because a stage
    infers its send/receive buffers once; a later batch of another size would be received into
    the old buffers (silently wrong on gloo in torch 2.13).
    """

    module: nn.Module
    runners: "list[_StageForward]"
    original: nn.Module
    parts: Sequence[nn.Module]
    local: Sequence[nn.Module]

    def __init__(self, parts: Sequence[nn.Module], indices: Sequence[int], original: nn.Module, device: torch.device,
                 options: PipelineOptions, distributed: bool, group: Any = None) -> None:
        super().__init__()
        local = [parts[i] for i in indices]
        self.module = local[0] if len(local) == 1 else _holding(original, local)
        # Not submodules (no duplicate parameters): the stages' runners, the whole model, all parts, this rank's.
        object.__setattr__(self, "runners", [_StageForward(stage) for stage in local])
        object.__setattr__(self, "original", original)
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "local", local)
        self.indices, self.n_stages, self.device, self.options = list(indices), len(parts), device, options
        self.distributed = distributed  # False: a world of one, no process group: plain micro-batching
        self.kept_whole: list[nn.Parameter] = []  # weights two of its stages share, whole beside sharded replicas
        self.group = group  # the stages' process group (None: every rank is a stage of one pipeline)
        # pipelines side by side shard a stage over its replicas (FSDP2): every replica's stage must run as many
        # forwards, but the replicas' evaluation batches differ in size (the last one, padding): one chunk each
        self.eval_whole = False
        self._schedules: dict[tuple, Any] = {}
        self._loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._checked = False

    @property
    def is_first(self) -> bool:
        return 0 in self.indices

    @property
    def is_last(self) -> bool:
        return self.n_stages - 1 in self.indices

    def set_context(self, context: Callable[[], Any]) -> None:
        """What each stage's forward runs under (the precision's autocast)."""
        for runner in self.runners:
            runner.context = context

    def counted_elsewhere(self) -> list[nn.Parameter]:
        """Tied parameters whose gradient a stage of an earlier rank holds too (the norm counts them there)."""
        return [p for stage in self.local for p in getattr(stage, "counted_elsewhere", list)()]

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
            from torch.distributed import pipelining

            stages = [pipelining.PipelineStage(runner, index, self.n_stages, self.device, group=self.group)
                      for runner, index in zip(self.runners, self.indices)]
            looped = self.options.schedule in LOOPED  # a list of this rank's stages, else its one stage
            # an evaluation runs forwards only, in the order of the stages' placement
            name = self.options.schedule if training else "loopedbfs" if looped else "gpipe"
            if not training and self.options.schedule in V_SHAPED:
                cls = _forward_only_v(pipelining)
            else:
                cls = getattr(pipelining, SCHEDULE_CLASSES[name])
            self._schedules[key] = cls(stages if looped else stages[0], n,
                                       loss_fn=self._micro_loss if training else None, scale_grads=False)
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
                losses.append(loss(self._run_local(xc), yc))
                losses[-1].backward()
        else:
            # The schedule's ``losses``, not our own record of loss_fn calls: in torch 2.13 the
            # first step of a schedule also calls loss_fn once to infer gradient shapes.
            self._loss = loss
            schedule = self._schedule(x.shape, n, training=True)
            # a tied weight's gradient before this backward, per stage that syncs one
            shared: list[list[Any]] = [getattr(stage, "shared_grads", list)() for stage in self.local]
            schedule.step(*((x,) if self.is_first else ()), target=y if self.is_last else None,
                          losses=losses if self.is_last else None, return_outputs=False)
            for stage, before in zip(self.local, shared):
                if before:  # summed with the other rank's stage holding it (GPT-2's tied embedding)
                    cast(Any, stage).sync_shared(before)
        return [t.detach() for t in losses]

    def _run_local(self, x: torch.Tensor) -> torch.Tensor:
        """A world of one: every stage here, in order."""
        for runner in self.runners:
            x = runner(x)
        return x

    def eval_step(self, x: torch.Tensor) -> torch.Tensor | None:
        """Forward only; the model's output on the last stage, ``None`` elsewhere."""
        if not self.distributed:
            return self._run_local(x)
        n = self.options.n_microbatches if len(x) % self.options.n_microbatches == 0 and not self.eval_whole else 1
        out = self._schedule(x.shape, n, training=False).eval(*((x,) if self.is_first else ()))
        return out if self.is_last else None
