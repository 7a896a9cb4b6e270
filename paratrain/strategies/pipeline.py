"""``pipeline``: one stage of the model per process, micro-batches flowing through the stages.

Built on ``torch.distributed.pipelining``: the model's top-level children are cut into one
consecutive stage per process (at ``split_points``, or balanced by parameter count), each rank
wraps its stage in a ``PipelineStage``, and ``ScheduleGPipe`` (all forwards, then all backwards)
or ``Schedule1F1B`` (one forward, one backward: fewer activations alive) runs a step. The looped
schedules (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``) cut
``pp * stages_per_rank`` stages and give pipeline rank ``q`` the stages ``q``, ``q + pp``, ...; the V-shaped
ones (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) cut ``2 pp`` and give it ``q`` and ``2 pp - 1 - q``: one
``PipelineStage`` each, held in one module under the model's own keys (:class:`PipelineModule`).

Data: the pipeline is *one* data-parallel replica. Every rank loads the same micro-batch
(``data_parallel_size = 1``); the first stage feeds the inputs, the last one the targets, and the
schedule cuts the batch into ``n_microbatches``. The loss is computed on the last stage;
``training_step`` broadcasts its mean to every rank, and ``all_reduce_sum`` (the metric
reduction over replicas) takes the last stage's values, so ``fit``'s logged loss and
``evaluate``'s counts are right on every rank.

Numerics equal a one-process loop for models without BatchNorm: each micro-batch loss is divided
by ``n_microbatches`` (and by the accumulation steps) before the schedule's backward. BatchNorm
normalises each of the ``n_microbatches`` chunks on its own and updates its running statistics once
per chunk (as GPipe does); setup says so once. The schedules' own ``scale_grads``
is off because it divides *all* of ``.grad`` after the step, which would also shrink gradients
accumulated in earlier micro-steps (torch 2.13).

Parameters and checkpoints: every rank holds the whole model (unless it was built under
``init_module``: then only its stage, :meth:`PipelineStrategy.held_parts`), but only its stage is
moved to the device and trained: :meth:`PipelineStrategy.setup_optimizer` keeps only the stage's parameters in
the optimizer's groups. ``ParallelModule.state_dict()`` is therefore meaningful only for this
rank's stage; :meth:`PipelineStrategy.full_state_dict` gathers the trained model on every rank.
Checkpoints go through ``torch.distributed.checkpoint`` like fsdp's: each rank writes its
stage's parameters and optimizer state under the user's parameter names, so a pipeline
checkpoint loads into a pipeline of another depth, or into ddp/single/fsdp, and back.

fp16-mixed is refused (each stage would skip overflowing steps on its own); use bf16-mixed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..env.process import Dist
from ..precision import lookup as precision_class
from ._stack import StackStage
from ._stages import (LOOPED, SPLIT_BACKWARD, PipelineModule, PipelineOptions, check_positions, cut_stages,
                      stage_ranks)
from ..checkpoint.sharded import full_state_dict as sharded_full_state_dict
from ..dtensors import local_part
from ..nn.deferred import Held, has_meta
from .base import NotApplicable, Strategy, data_parallel_size, mesh_dimensions
from .fsdp import FSDPOptions, ParameterSwap, scale_grads_, shard_model, shard_root, total_norm
from .mesh import data_parallel_mesh, layout_mesh
from .tensor import TensorOptions, checked_plan, parallel_style

__all__ = ["PipelineOptions", "PipelineStrategy", "PipelineModule", "cut_stages"]


@dataclass
class PipelineParts:
    """What the pipeline strategy is built with: its own section, and those of the parts it composes
    with in a mesh (``tensor``'s plan for ``tp``, ``fsdp``'s sharding settings for ``dp_shard``)."""

    pipeline: "PipelineOptions"
    tensor: Any = None
    fsdp: Any = None

    def __post_init__(self) -> None:
        self.tensor = self.tensor if self.tensor is not None else TensorOptions()
        self.fsdp = self.fsdp if self.fsdp is not None else FSDPOptions()


class PipelineStrategy(Strategy):
    name = "pipeline"
    collective_forward = True
    sharded_state = True  # each rank checkpoints its stage through DCP
    stage_per_process = True
    local_overflow_skip = False
    options_class = PipelineOptions

    @classmethod
    def validate(cls, cfg: Any) -> None:
        super().validate(cfg)
        if cfg.mesh.tp not in (None, 1) and precision_class(cfg.precision).scales_loss and cfg.loss_scale is None:
            raise ValueError(f"precision {cfg.precision} is not supported with mesh {cfg.mesh}: use bf16-mixed or 32")
        # One pipeline's step batch is global_batch / accumulation (its share of it, with data parallel pipelines).
        n = cfg.pipeline.n_microbatches
        step_batch = cfg.micro_batch or cfg.global_batch // (cfg.accumulation or 1)
        if step_batch % n:
            raise ValueError(f"pipeline n_microbatches={n} does not divide the batch of {step_batch} samples per step "
                             f"(global_batch {cfg.global_batch}): use a global batch that is a multiple of {n}")

    @classmethod
    def options_of(cls, cfg: Any) -> PipelineParts:
        return PipelineParts(cfg.pipeline, cfg.tensor, cfg.fsdp)

    @classmethod
    def layout_for(cls, world: int, options: Any = None) -> dict[str, int]:
        return {"pp": world}

    def __init__(self, dist_info: Dist, sync_batchnorm: bool = False, options: PipelineParts | PipelineOptions | None = None,
                 **common: Any) -> None:
        parts = options if isinstance(options, PipelineParts) else PipelineParts(options or PipelineOptions())
        super().__init__(dist_info, sync_batchnorm, parts.pipeline, **common)
        self.parts = parts
        self._pipes: dict[int, PipelineModule] = {}  # id(user's model) -> its stage
        # The mesh (pp, dp_replicate, dp_shard, tp), row-major: rank = stage * (dp * tp) + column, where the
        # column (data-parallel replica, tp slice) is the same for the stages of one pipeline.
        self.stages = self.layout.get("pp", dist_info.world_size)
        self.dp = data_parallel_size(self.layout)
        self.tp = self.layout.get("tp", 1)
        self.stage_index, self.column = divmod(dist_info.rank, self.dp * self.tp)  # stage_index: the pipeline rank
        self.replica, self.tp_rank = divmod(self.column, self.tp)
        # the pipeline rank that holds each stage (several a rank: looped, or in a V where rank 0 holds the last)
        self.placement = stage_ranks(self.options.schedule, self.stages, self.stages * self.options.stages_per_rank)
        self.swap = ParameterSwap()
        self._meshes: tuple[Any, Any] | None = None

    # --- data layout: the stages of one pipeline see the same batch -------------------------
    @property
    def data_parallel_size(self) -> int:
        return self.dp

    @property
    def data_parallel_rank(self) -> int:
        return self.replica

    @property
    def data_parallel_leader(self) -> bool:
        return self.stage_index == 0 and self.tp_rank == 0

    @property
    def _composed(self) -> bool:
        return self.dp * self.tp > 1  # pipelines side by side, or stages split over tp

    def _mesh(self) -> tuple[Any, Any]:
        """``(pp x dp_replicate x dp_shard x tp mesh, (pp, dp, tp) mesh)`` for a composed pipeline (made on every rank)."""
        if self._meshes is None:
            whole = layout_mesh(self.device.type, self.layout)
            # the same ranks with the data-parallel dimensions as one: the group the replicas' metrics are summed over
            flat = layout_mesh(self.device.type, {"pp": self.stages, "dp": self.dp, "tp": self.tp}, ("pp", "dp", "tp"))
            self._meshes = (whole, flat)
        return self._meshes

    def comm_dimensions(self) -> dict[str, str]:
        if self._meshes is None:  # the world is one pipeline: its default group is pp
            return super().comm_dimensions()
        whole, flat = self._meshes  # flat's pp group carries the activations between stages
        return {**mesh_dimensions(whole), **mesh_dimensions(flat)}

    @property
    def _stage_group(self) -> Any:
        return self._mesh()[1]["pp"].get_group() if self._composed else None  # None: the world is one pipeline

    def _last_stage_rank(self) -> int:
        """The global rank, in this rank's pipeline (its data-parallel replica and tp slice), that holds the last stage."""
        return self.proc.rank + (self.placement[-1] - self.stage_index) * self.dp * self.tp

    # --- model ----------------------------------------------------------------------------
    def setup_model(self, model: nn.Module) -> nn.Module:
        n = self.options.n_microbatches
        stages = self.stages
        if self.options.schedule == "1f1b" and stages > 1 and n < stages:  # torch refuses it at the first step
            raise ValueError(f"pipeline schedule 1f1b needs at least one micro-batch per stage: n_microbatches={n} "
                             f"< {stages} stages; set n_microbatches >= {stages}, or schedule gpipe")
        if self.options.schedule == "dualpipev" and n < 2 * stages:  # torch refuses it at the first step
            raise ValueError(f"pipeline schedule dualpipev needs at least one micro-batch per stage: n_microbatches={n} "
                             f"< {2 * stages} stages (2 a rank); set n_microbatches >= {2 * stages}, or schedule "
                             "zbvzerobubble")
        rounds = max(1, n // stages)  # the interleaved schedules run the micro-batches in rounds of pp
        if self.options.schedule in LOOPED and n % rounds:
            raise ValueError(f"pipeline schedule {self.options.schedule} runs micro-batches in rounds of {stages} "
                             f"(the pipeline ranks): n_microbatches={n} is not a multiple of its {rounds} rounds; "
                             f"use a multiple of {stages}")
        if self.sync_batchnorm:
            self.warn("sync_batchnorm has no effect with pipeline: a stage's BatchNorm is on one rank, and sees "
                      f"each of the step's {n} micro-batches on its own", rank=self.proc.rank)
        elif n > 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            self.warn(f"pipeline n_microbatches={n}: BatchNorm normalises each micro-batch on its own (and updates its "
                      "running statistics once per micro-batch), not the whole batch; n_microbatches=1 keeps the "
                      "one-process numerics but runs the stages one after another", rank=self.proc.rank)
        return self.wrap(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        o: PipelineOptions = self.options
        distributed = self.proc.backend is not None and self.proc.world_size > 1
        if distributed and self._composed:
            self._mesh()  # its groups, on every rank in the same order, before the tied parameters' groups
        plan = checked_plan(model, self.tp, self.parts.tensor.plan) if self.tp > 1 else {}  # the whole model's
        per_rank = o.stages_per_rank
        parts = cut_stages(model, self.stages * per_rank, self.stage_index, o.split_points, distributed,
                           self.dp * self.tp, self.column, self.placement)
        mine = [s for s, q in enumerate(self.placement) if q == self.stage_index]  # only these live on its device
        whole = self._ties_within_the_rank(parts, mine) if distributed and self._composed and self.dp > 1 else []
        for index in mine:
            self._place(model, parts[index], plan, distributed, whole)
        pipe = PipelineModule(parts, mine, model, self.device, o, self.proc.backend is not None,
                              self._stage_group if distributed else None)
        if distributed and self._composed and self.dp > 1:
            # Each stage's runner (what torch's PipelineStage runs) is the FSDP2 root over its sharded stage, so that
            # torch's schedules see an FSDP module: they defer the gradients' reduction to the step's end (REDUCE_GRAD).
            # Under an inner root, a zero-bubble schedule's input-gradient action ran FSDP's post-backward hook before
            # its weight-gradient action had computed anything: the stage's gradients were lost.
            mesh = data_parallel_mesh(self._mesh()[0], self.layout)
            for runner in pipe.runners:
                shard_root(runner, mesh, self._stage_fsdp(), self.precision, set(whole) or None)
        pipe.kept_whole = whole
        if self._composed:
            pipe._checked = True  # the whole model's forward would gather other stages' shards: not checked
            pipe.eval_whole = self.dp > 1
        self._pipes[id(model)] = pipe
        return pipe

    def _place(self, model: nn.Module, stage: nn.Module, plan: dict[str, Any], distributed: bool,
               whole: Sequence[nn.Parameter] = ()) -> None:
        """Put one of this rank's stages on its device, split over its tp ranks and replicated or sharded over its
        data-parallel ones in a composed layout (but for the parameters in ``whole``, which stay whole on each)."""
        if has_meta(model):
            pass  # built under init_module: setup materialises only this rank's stages on the device (held_parts)
        elif isinstance(stage, StackStage):
            stage.place(self.device)  # with the buffers its blocks share with the whole model
        else:
            stage.to(self.device)
        if not (distributed and self._composed):
            return
        whole_mesh = self._mesh()[0]
        old = self.swap.before(stage)
        if self.tp > 1:  # the stage's part of the plan over its tp ranks, then FSDP2 over the data-parallel ones
            from torch.distributed.tensor.parallel import parallelize_module

            names = {id(m): n for n, m in stage.named_modules()}
            mine = {names[id(model.get_submodule(fqn))]: s for fqn, s in plan.items()
                    if id(model.get_submodule(fqn)) in names}
            if mine:
                parallelize_module(stage, whole_mesh["tp"], {n: parallel_style(s) for n, s in mine.items()})
        if self.dp > 1:  # the stage replicated or sharded over its data-parallel ranks (FSDP2, HSDP)
            shard_model(stage, data_parallel_mesh(whole_mesh, self.layout), self._stage_fsdp(), self.precision,
                        stage.blocks() if isinstance(stage, StackStage) else None, ignored=set(whole) or None)
        self.swap.after(stage, old)
        if isinstance(stage, StackStage):
            stage.follow(self.swap)

    def _ties_within_the_rank(self, parts: Sequence[nn.Module], mine: list[int]) -> list[nn.Parameter]:
        """The weights two of this rank's stages share (the V places GPT-2's tied embedding and head on rank 0). Each
        stage is its own FSDP2 unit, and two would shard one weight apart: such a weight stays whole on every replica,
        its gradient (both stages', summed by autograd) averaged over them after each step (:meth:`_average_whole`)."""
        seen: dict[int, int] = {}  # id(parameter) -> the first of this rank's stages holding it
        tied: dict[int, nn.Parameter] = {}
        for s in mine:
            for p in parts[s].parameters():
                if seen.setdefault(id(p), s) != s:
                    tied[id(p)] = p
        return list(tied.values())

    def _average_whole(self, pipe: PipelineModule, before: list[torch.Tensor | None]) -> None:
        """The step's gradient of each weight kept whole (:meth:`_ties_within_the_rank`), averaged over the replicas,
        as FSDP averages the others'; what it held before the step (accumulation) is the same on every replica."""
        group = self._mesh()[1]["dp"].get_group()
        for p, old in zip(pipe.kept_whole, before):
            if p.grad is None:
                continue
            step = p.grad - old if old is not None else p.grad.clone()
            dist.all_reduce(local_part(step), op=dist.ReduceOp.SUM, group=group)
            p.grad = step / self.dp if old is None else old + step / self.dp

    def _stage_fsdp(self) -> FSDPOptions:
        """How a stage is sharded over its replicas. A zero-bubble schedule computes a micro-batch's weight gradients
        after other micro-batches' forwards: the stage's parameters stay gathered from its first forward to the step's
        end (where torch's REDUCE_GRAD reshards them), for a forward that resharded them would leave the weight
        gradients nothing to land on. The others gather them again for each backward (FSDP's default)."""
        fsdp = self.parts.fsdp
        if self.options.schedule in SPLIT_BACKWARD and fsdp.reshard_after_forward:
            return replace(fsdp, reshard_after_forward=False)
        return fsdp

    def unwrap(self, model: nn.Module) -> nn.Module:
        """This rank's stage (its layers of the user's model; its stages' with several a rank)."""
        return self._pipeline(model).module

    def checkpoint_module(self, wrapped: nn.Module, original: nn.Module) -> nn.Module:
        """This rank's stage (or stages): the only parameters a pipeline rank holds."""
        return self._pipeline(wrapped).module

    def held_parts(self, wrapped: nn.Module, original: nn.Module) -> Held:
        """This rank's stages, and the buffers of what every stage runs (a rotary embedding's):
        a model built under ``init_module`` keeps the other stages' blocks on the meta device."""
        local = self._pipeline(wrapped).local
        outside = {id(m): m for stage in local if isinstance(stage, StackStage) for m in stage.run_outside()}
        return Held(tuple(local), tuple(outside.values()))

    def setup_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Keep only this stage's parameters in ``optimizer`` (built over the whole model): the
        others are trained on other ranks, and the optimizer's state then names only the stage's
        parameters, which is what its checkpoint holds."""
        optimizer = self.swap.rebuild(optimizer, self.name)  # over a sharded stage's DTensor parameters
        mine = {id(p) for p in self._pipeline(model).module.parameters()}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in mine]
        for p in [p for p in optimizer.state if id(p) not in mine]:
            del optimizer.state[p]
        return optimizer

    def _pipeline(self, model: nn.Module) -> PipelineModule:
        for m in (model, getattr(model, "module", None)):
            if isinstance(m, PipelineModule):
                return m
            if m is not None and id(m) in self._pipes:
                return self._pipes[id(m)]
        raise ValueError("pipeline: this model was not set up by this Parallel: call pt.setup(model) first")

    # --- the step -------------------------------------------------------------------------
    def training_step(self, model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor],
                      backward: Callable[[Any], None]) -> torch.Tensor:
        """Run the schedule over one micro-batch ``(x, y)``; returns the mean micro-batch loss,
        the same (detached) value on every rank.

        The schedule runs backward itself, so it is handed to ``backward`` as a callable
        (``Parallel.backward`` counts the micro-step and passes the accumulation divisor).
        """
        pipe = self._pipeline(model)
        x, y = batch
        n = self.options.n_microbatches
        if len(x) % n:
            raise NotApplicable(
                f"pipeline: a step's batch of {len(x)} samples is not divisible by n_microbatches={n}: "
                f"pick a global batch (/ accumulation) that is a multiple of {n}"
            )
        pipe.check(x[: len(x) // n])
        # the precision's autocast inside each stage
        pipe.set_context(self.precision.forward_context if self.precision.autocast else contextlib.nullcontext)
        mean = torch.zeros((), device=self.device)

        def run(divisor: int) -> None:
            def micro_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                # Each micro-batch's mean divided by n (and the accumulation steps): the summed
                # gradients are those of one forward over the whole batch.
                # half outputs in fp32, float64 stays float64
                check_positions(out, target, type(pipe.original).__name__)
                return loss_fn(out.to(torch.promote_types(out.dtype, torch.float32)), target) / (n * divisor)

            before = [None if p.grad is None else p.grad.clone() for p in pipe.kept_whole]
            losses = pipe.train_step(x, y, n, micro_loss)
            if pipe.kept_whole:
                self._average_whole(pipe, before)
            if losses:
                mean.copy_(torch.stack(losses).sum() * divisor)

        backward(run)
        return self._from_last_stage(mean)

    def eval_forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        pipe = self._pipeline(model)
        pipe.check(x)
        return pipe.eval_step(x)

    # --- collectives ----------------------------------------------------------------------
    def _from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.proc.backend is not None and self.stages > 1:
            dist.broadcast(tensor, src=self._last_stage_rank(), group=self._stage_group)
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel replicas (pipelines side by side), whose metrics (losses, eval
        totals) are computed on their last stage: every rank gets the sum of the last stages' values."""
        self._from_last_stage(tensor)
        if self.proc.backend is not None and self.dp > 1:  # the tp ranks of a replica hold the same values
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._mesh()[1]["dp"].get_group())
        return tensor

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient: the stages' squared norms are summed."""
        params = [p for p in parameters if p.grad is not None]
        twice = {id(p) for pipe in self._pipes.values() for p in pipe.counted_elsewhere()}
        # the whole stage's norm (its shards and tensor-parallel slices reduced: fsdp's total_norm)
        norm = total_norm([g for p in params if (g := p.grad) is not None and id(p) not in twice])
        total = norm.to(self.device, torch.promote_types(norm.dtype, torch.float32)) ** 2  # float64 stays float64
        if self.proc.backend is not None and self.stages > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._stage_group)
        total = total.sqrt()
        scale_grads_([g for p in params if (g := p.grad) is not None], total, max_norm)
        return total

    # --- checkpoints ----------------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole trained model's state dict (CPU tensors, the user's keys) on every rank:
        each stage contributes its own entries. A collective: call it on all ranks."""
        pipe = self._pipeline(model)
        if self._composed:  # a sharded or split stage: its whole tensors first (a collective over its dp and tp ranks)
            local = {k: v.detach().cpu() for k, v in sharded_full_state_dict(pipe.module).items()}
        else:
            local = {k: v.detach().cpu() for k, v in pipe.module.state_dict().items()}
        gathered = [local]
        if self.proc.backend is not None and self.proc.world_size > 1:
            gathered = [{} for _ in range(self.proc.world_size)]
            dist.all_gather_object(gathered, local)
        merged: dict[str, torch.Tensor] = {}
        for stage_state in gathered:
            merged.update(stage_state)
        # In the model's own key order; entries outside every stage (top-level buffers) are local.
        return {k: merged[k] if k in merged else v.detach().cpu() for k, v in pipe.original.state_dict().items()}
