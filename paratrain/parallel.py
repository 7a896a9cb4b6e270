"""``Parallel``: the small API that takes a user's own training loop to N workers.

A hand-written DDP loop converts by changing a few lines::

    pt = paratrain.Parallel(strategy="ddp", precision="fp16-mixed", global_batch=256)
    model, optimizer = pt.setup(model, optimizer)      # device, SyncBN, DDP, autocast
    loader = pt.train_loader(trainset)                 # sharded, seeded, no set_epoch
    for epoch in range(epochs):
        for images, labels in loader:                  # already on the device
            optimizer.zero_grad()
            loss = criterion(model(images), labels)
            pt.backward(loss)                          # was: loss.backward()
            optimizer.step()                           # steps once per global batch

With accumulation, ``backward`` divides the loss by the number of micro-steps and gradient
all-reduce is switched off on all but the last one; ``optimizer.step()``/``zero_grad()`` only act
at the step boundary, so the loop body stays the same (the rules: :mod:`paratrain.clock`).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from collections.abc import Iterable, Mapping
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import checkpoint as checkpoint_lib
from . import evaluation, strategies, tracking
from . import metrics as metrics_lib
from . import precision as precision_lib
from .clock import ClockCount, StepClock
from .config import ParallelConfig
from .data import prepare
from .data.loaders import EvalLoader, GlobalBatchLoader
from .data.stream import StreamLoader
from .data.sampler import BatchPlan
from .env import lock, preemption, process, seeding
from .env.provenance import provenance
from .metrics import mapping_loss
from .nn.deferred import Deferred
from .precision import PrecisionName, Stepped
from .strategies import DDPOptions, DevicesOptions, FSDPOptions, PipelineOptions, PSOptions, StrategyName, TensorOptions
from .guards import check_first_backward, check_setup_arguments
from .wrappers import (ParallelModule, ParallelOptimizer, ParallelScheduler, attach_scheduler, checkpointed,
                       compiled_like, is_compiled, registered_optimizer, strategy_module, uncompiled, unwrapped)

__all__ = ["Parallel", "ParallelModule", "ParallelOptimizer", "ParallelScheduler"]


class Parallel(process.OnProcess, tracking.TrackedRun):
    """Process setup + strategy + precision + global-batch data, for a loop the user writes.

    Pass a :class:`~paratrain.config.ParallelConfig`, or its fields as keyword arguments (each
    one left out, or ``None``, keeps its default, or the launch-time default of ``paratrain run``).
    Metrics go where :meth:`log` writes, on the main process only.

    Args:
        config: All the options below at once (then pass none of them).
        log_to: Trackers: ``["csv", "tensorboard", "wandb", "mlflow", "comet"]`` or ``"csv,wandb"``,
            and :class:`~paratrain.tracking.Tracker` instances among the names.
        log_dir: Where the trackers write (default: a new ``runs/<start time>``).
        loggers: More :class:`~paratrain.tracking.Tracker` instances.
        plan: A :class:`~paratrain.data.sampler.BatchPlan` made earlier in this process for this world.
    """

    def __init__(self, config: ParallelConfig | None = None, *, strategy: StrategyName | str | None = None,
                 precision: PrecisionName | str | None = None, global_batch: int | None = None,
                 accumulation: int | None = None, micro_batch: int | None = None, sync_batchnorm: bool | None = None,
                 clip_grad_norm: float | None = None, loss_scale: float | None = None, seed: int | None = None,
                 backend: str | None = None, accelerator: str | None = None, timeout_s: float | None = None,
                 check_collectives: bool | None = None,
                 compile: bool | None = None, compile_backend: str | None = None, activation_checkpointing: Any = None,
                 ddp: DDPOptions | Mapping[str, Any] | None = None, fsdp: FSDPOptions | Mapping[str, Any] | None = None,
                 tensor: TensorOptions | Mapping[str, Any] | None = None,
                 pipeline: PipelineOptions | Mapping[str, Any] | None = None,
                 devices: DevicesOptions | Mapping[str, Any] | None = None, ps: PSOptions | Mapping[str, Any] | None = None,
                 mesh: strategies.MeshOptions | Mapping[str, Any] | str | None = None,
                 log_to: str | Iterable[str | tracking.Tracker] | None = None, log_dir: str | None = None,
                 loggers: Iterable[tracking.Tracker] = (), plan: BatchPlan | None = None) -> None:
        given = locals()  # the options given (not None): ParallelConfig's fields, named one by one above
        options = {name: given[name] for name in ParallelConfig.option_names() if given[name] is not None}
        cfg = ParallelConfig.of(config, options)
        self.dist = process.init(None if cfg.backend == "auto" else cfg.backend, cfg.timeout_s, cfg.accelerator)
        self.config = cfg = cfg.for_world(self.dist.world_size)  # strategy "auto": single or ddp
        process.joined(self.dist, cfg.check_collectives)  # a failed collective: its one-line cause; checked mode
        self.precision = precision_lib.build(cfg.precision, self.device, cfg.loss_scale)
        self.strategy = strategies.build(cfg, self.dist, self.precision)  # it asks the precision what to do
        self.plan = cfg.batch_plan(self.world_size, plan)  # ``plan``: one the caller made for this world
        # Same seed on every rank: identical initial weights, identical global data order.
        seeding.seed_everything(cfg.seed)
        self._clock = StepClock(self.plan.accumulation, lambda opt, ends: self.strategy.step(opt, self._models, ends))
        self._models: list[nn.Module] = []  # what the strategy made of each model set up
        # checked on every rank (a bad name fails everywhere alike); opened on the main process only
        self.trackers = tracking.Trackers(log_to, log_dir, loggers, enabled=self.is_main_process, config=self._run_config)
        self._deferred = Deferred(self.strategy.sharded_state and self.world_size > 1, self.device)
        lock.held(self).hold(log_dir, "log_dir")  # one run per folder (rank 0 holds it; checkpoint folders too)
        self._stop = preemption.stop_signal(self.is_main_process)  # SIGTERM/SIGUSR1: stop at a step boundary

    # --- who am I (rank, world_size, is_main_process, device, print: env.process.OnProcess) --------
    @property
    def data_parallel_leader(self) -> bool:
        """Is this the lowest rank of those that read the same data shard (one per shard)?"""
        return self.strategy.data_parallel_leader

    accumulation = property(lambda self: self.plan.accumulation, doc="Micro-steps per optimizer step.")
    global_batch = property(lambda self: self.plan.global_batch, doc="Samples per optimizer step over all ranks.")
    global_step = ClockCount("Optimizer steps taken (the data position).")
    micro_step = ClockCount("Backward calls since the last optimizer step (0 at a global batch's start).")

    def describe(self) -> dict[str, Any]:
        """Where this job runs: world and data-parallel size, strategy, backend, device (a run's provenance)."""
        return {"world_size": self.world_size, "data_parallel_size": self.plan.world_size, "strategy": self.config.strategy,
                "mesh": self.config.mesh_name(self.world_size), "backend": self.dist.backend, "device": str(self.device)}

    def report(self) -> dict[str, Any]:
        """Strategy-specific numbers for a run's summary (e.g. the parameter server's updates)."""
        return self.strategy.report()

    def _run_config(self) -> dict[str, Any]:
        return {"parallel": asdict(self.config), "provenance": provenance(self.describe())}

    # --- model and optimizer ---------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None) -> Any:
        """Place and wrap ``model`` for the strategy and precision; wrap ``optimizer`` and
        ``scheduler`` if given.

        Returns a :class:`ParallelModule`, or ``(module, optimizer)``, or ``(module, optimizer,
        scheduler)``. Parameters are kept (moved in place), so an optimizer built before ``setup``
        stays valid, also under fsdp/tensor, whose sharded parameters it is pointed at in place: a
        scheduler built on it keeps acting on the optimizer that steps, passed to ``setup`` or not.
        The returned scheduler's ``step()`` acts once per optimizer step whatever the accumulation
        (see :class:`ParallelScheduler`).
        """
        check_setup_arguments(model, optimizer, scheduler, self._models)
        compiled = model if is_compiled(model) else None
        original = uncompiled(model)  # its keys are the checkpoint's, compiled or not
        values = self._deferred.values(original)  # built under init_module: what each tensor's shard holds
        wrapped, original = self.strategy.prepare_model(original)  # a wrapper the user made (their DDP) is kept
        self._deferred.materialize(original, values, self.strategy.held_parts(wrapped, original))
        runner = compiled_like(compiled, wrapped, self.config.compile, self.config.compile_backend)
        module = ParallelModule(runner, original, self.precision, self._before_forward, self.strategy.model_loaded,
                                wrapped, self.strategy.checkpoint_module(wrapped, original))
        self._models.append(wrapped)
        if callable(getattr(original, "generate", None)) and hasattr(original, "config"):
            module.mark_forward_method("generate")  # HuggingFace's: its forwards run under autocast
        if optimizer is None:
            return module
        wrapped_optimizer = self.setup_optimizer(optimizer, module, scheduler)
        return (module, *wrapped_optimizer) if scheduler is not None else (module, wrapped_optimizer)

    def init_module(self) -> Any:
        """``with pt.init_module(): model = Model()``: under fsdp, tensor, pipeline and meshes, built on the meta
        device; :meth:`setup` gives each rank only its shards (a pipeline rank its stage), valued as a whole
        build would be (:mod:`paratrain.nn.deferred`). Otherwise built whole on this rank's device."""
        return self._deferred.context()

    def mark_forward_method(self, model: nn.Module, name: str) -> None:
        """Run ``model.<name>(...)`` (an ``encode``, ``generate``: marked by :meth:`setup` on a HuggingFace
        model) as its forward runs: fsdp gathers the root's shards around it, under the precision's autocast."""
        if not isinstance(model, ParallelModule):
            raise ValueError(f"mark_forward_method takes the model pt.setup returned, not a {type(model).__name__}")
        model.mark_forward_method(name)
        self.strategy.mark_forward_method(model.module, name)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None,
                        scheduler: Any = None) -> Any:
        """One more optimizer for a model already set up (default: the last one), e.g. SparseAdam
        for the embeddings and AdamW for the rest; step each after the same backward, as in a plain
        loop. Returns the optimizer, or ``(optimizer, scheduler)``, as :meth:`setup` does."""
        inner = self.strategy.prepare_optimizer(strategy_module(model, self._models), optimizer)
        self._clock.optimizers.append(inner)
        wrapped_optimizer = ParallelOptimizer(inner, self._clock)
        if scheduler is None:
            return wrapped_optimizer
        return wrapped_optimizer, ParallelScheduler(attach_scheduler(scheduler, wrapped_optimizer), self._clock)

    def register_scheduler(self, scheduler: Any, optimizer: ParallelOptimizer | None = None) -> Any:
        """Let paratrain step ``scheduler`` after every optimizer step (don't call its ``step()``
        yourself). Built on the optimizer from :meth:`setup`, or on the one passed to it (then
        pass the returned optimizer as ``optimizer``). It goes into checkpoints by default."""
        optimizer = registered_optimizer(scheduler, optimizer)
        self._clock.drive(attach_scheduler(scheduler, optimizer), optimizer.optimizer)
        return scheduler

    def _before_forward(self, wrapped: nn.Module) -> None:
        # Decide before DDP's forward whether this micro-step's backward all-reduces (no_sync).
        if self.accumulation > 1:
            self.strategy.set_gradient_sync(wrapped, self._clock.last_micro_step)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module without paratrain/DDP/DataParallel wrappers (for saving or evaluation)."""
        return unwrapped(model, self.strategy.unwrap)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state (unsharded, every pipeline stage) as CPU tensors. Collective."""
        return self.strategy.full_state_dict(self.unwrap(model))

    def save_pretrained(self, model: nn.Module, directory: str | os.PathLike[str], **kwargs: Any) -> None:
        """``save_pretrained(directory, **kwargs)`` of a HuggingFace model (anything with that
        method) under any strategy: the whole state gathered (:meth:`full_state_dict`), written by
        the main process. Collective: call it on every rank. (Under fsdp/tensor the module's own
        ``save_pretrained`` would meet sharded parameters.)"""
        checkpoint_lib.save_pretrained(self.unwrap(model), lambda: self.full_state_dict(model), directory,
                                       self.is_main_process, **kwargs)

    def load_weights(self, model: nn.Module, path: str | os.PathLike[str], strict: bool = True) -> None:
        """Load exported safetensors weights (``paratrain export``, ``save_pretrained``, HuggingFace's
        numbered files) into the set-up ``model``, one tensor at a time: each rank keeps only its shards,
        also of a model built under :meth:`init_module` (:func:`paratrain.checkpoint.load_weights`)."""
        checkpoint_lib.load_weights(self.unwrap(model), path, strict)

    comm_dimensions = property(lambda self: self.strategy.comm_dimensions(),
                               doc="Each process group's name -> the layout dimension it carries (pp, tp...).")

    def hidden_comm_bytes_per_step(self, model: nn.Module) -> int:
        """Bytes sent per optimizer step outside ``torch.distributed``'s Python calls (ps's RPC...)."""
        return self.strategy.hidden_comm_bytes_per_step(model)

    # --- the step (the rules: paratrain.clock) --------------------------------------------
    def autocast(self) -> ContextManager[Any]:
        """``with pt.autocast(): loss = F.cross_entropy(model(x), y)``, as PyTorch's AMP recipe: the precision's
        autocast (none in fp32), under which outputs stay as it made them (:meth:`ParallelModule._autocast`)."""
        return self.precision.forward_context()

    def backward(self, loss: torch.Tensor | Callable[[int], None]) -> None:
        """Backward of one micro-batch's loss (averaged over the accumulation steps). A strategy whose
        schedule runs backward itself (pipeline) passes a callable, called with the divisor to use."""
        if callable(loss):
            return self._clock.backward(loss)
        check_first_backward(loss, self._models, self.global_step + self.micro_step, self.strategy.sharded_state)
        self._clock.backward(lambda n: self.precision.backward(loss / n if n > 1 else loss),
                             lambda: (p for m in self._models for p in m.parameters()))

    def training_step(self, model: nn.Module, batch: Any,
                      loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy) -> torch.Tensor:
        """``loss_fn(model(inputs), targets)`` and :meth:`backward`, the way the strategy runs them. A dict
        batch runs ``model(**batch)`` with the model's own loss (HuggingFace's, given ``labels``)."""
        if isinstance(batch, Mapping):
            loss = mapping_loss(model, batch, loss_fn)
            self.backward(loss)
            return loss
        return self.strategy.training_step(model, batch, loss_fn, self.backward)

    def step(self, optimizer: torch.optim.Optimizer | ParallelOptimizer) -> bool | Stepped:
        """Step at the end of a global batch (no-op on earlier micro-steps). True if weights changed.

        Several optimizers work as in a plain loop: each stepping after the same backward (one per
        parameter group or model, ``opt_a.step(); opt_b.step()``), or each after a backward of its
        own (a GAN's discriminator and generator, one global step per round; accumulation 1)."""
        return self._clock.step(optimizer.optimizer if isinstance(optimizer, ParallelOptimizer) else optimizer)

    def scaled_step(self, optimizer: ParallelOptimizer, found_inf: torch.Tensor, grad_scale: Any) -> bool | Stepped:
        """:meth:`step` as the loop's own ``GradScaler`` drives it (``found_inf``, ``grad_scale``: None when the loop
        unscaled): inf/NaN gradients end the global batch as a skipped step (as paratrain's fp16 skips one: the data
        moves on, a registered scheduler steps); else the gradients are unscaled and the optimizer steps."""
        return self._clock.scaled_step(optimizer.optimizer, found_inf, grad_scale)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed (paratrain's loss scaling, or
        the loop's own ``GradScaler``: see :meth:`scaled_step`)."""
        return self.precision.skipped_steps + self._clock.scaler_skips

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale now (1.0 without loss scaling)."""
        return self.precision.loss_scale

    # --- data (paratrain.data.prepare) ----------------------------------------------------
    def train_loader(self, dataset: Dataset | DataLoader, transform: Callable[..., torch.Tensor] | None = None,
                     shuffle: bool | None = None, **dataloader_kwargs: Any) -> GlobalBatchLoader | StreamLoader:
        """Micro-batches of this rank, from the current global step, epoch after epoch, of a
        dataset, a stream (``IterableDataset``) or your own ``DataLoader`` (its sampler and batch size
        replaced, its other settings kept): see :func:`paratrain.data.prepare.train_loader`."""
        return self._clock.stream.made(prepare.train_loader(
            dataset, self.plan, self.strategy.data_parallel_rank, self.device, self.config.seed,
            position=lambda: self.global_step, reduce_max=self.strategy.all_reduce_max, say=self.print,
            where=f" over {self.world_size} processes", transform=transform, shuffle=shuffle, **dataloader_kwargs))

    def steps_per_epoch(self, dataset: Dataset) -> int:
        """Optimizer steps in one epoch of ``dataset`` (its global batches; the tail is dropped)."""
        return self.plan.steps_per_epoch(len(dataset), f" over {self.world_size} processes")  # type: ignore[arg-type]

    def any_rank(self, flag: bool | torch.Tensor) -> bool:
        """Whether ``flag`` is true on any rank (a collective over every rank)."""
        t = torch.as_tensor(flag, dtype=torch.float32).reshape(1).to(self.device, copy=True)
        return bool(self.strategy.all_reduce_max(t).item())

    def eval_loader(self, dataset: Dataset | DataLoader, batch_size: int | None = None,
                    transform: Callable[[torch.Tensor], torch.Tensor] | None = None, **dataloader_kwargs: Any) -> EvalLoader:
        """This rank's shard of an evaluation set: every sample exactly once across ranks. Your own ``DataLoader``
        keeps its dataset (the part its sampler selects), batch size, ``collate_fn`` and worker settings; its
        sampler is replaced by this rank's shard."""
        return prepare.eval_loader(dataset, batch_size, self.plan.micro_batch * self.accumulation,
                                   self.strategy.data_parallel_size, self.strategy.data_parallel_rank, self.device,
                                   transform, **dataloader_kwargs)

    def evaluate(self, model: nn.Module, loader: Dataset | DataLoader | EvalLoader | Iterable, loss_fn: Callable[..., Any] | None = None,
                 *, step_fn: Callable[[nn.Module, Any], Any] | None = None,
                 metrics: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Loss, accuracy (classification only) and your metrics over the whole evaluation set (a dataset, or
        your own DataLoader, is sharded as :meth:`eval_loader` shards it), reduced over ranks; ``count`` is the number
        of samples. How batches become predictions and targets: :func:`paratrain.evaluation.evaluate`."""
        loader = self.eval_loader(loader) if prepare.is_dataset(loader) else loader  # else batches
        return evaluation.evaluate(self.strategy, self.precision, self.device, self.unwrap(model), loader, loss_fn,
                                   step_fn=step_fn, metrics=metrics)

    # --- collectives for metrics -----------------------------------------------------------
    def all_gather(self, obj: Any) -> Any:
        """Every rank's tensor concatenated along dim 0 (sizes may differ), or every rank's
        picklable object in a list; see :func:`paratrain.metrics.all_gather`. Collective. Over the
        ranks that hold different evaluation data: under tensor parallelism the dp group (a tp
        group's ranks read the same shard)."""
        return metrics_lib.all_gather(obj, self.strategy.metrics_group)

    def reduce(self, value: Any, op: str = "mean") -> torch.Tensor:
        """``value`` (tensor or number) reduced over the ranks (as :meth:`all_gather` counts them):
        sum, mean, max, min or product. Collective."""
        return metrics_lib.reduce(value, op, self.device, self.strategy.metrics_group)

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average of ``value`` over the data-parallel ranks."""
        value = value.detach().clone().float()
        return self.strategy.all_reduce_sum(value) / self.strategy.data_parallel_size

    # --- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of the run itself: the global step (the data position), the
        global batch, seed and world size it was written with, and the precision's state."""
        return {"global_step": self.global_step, "global_batch": self.plan.global_batch, "seed": self.config.seed,
                "world_size": self.world_size, "precision": self.precision.state_dict(),
                "data": self._clock.stream.current}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict` of a run of this global batch and seed; any world size)."""
        checkpoint_lib.check_continues(state, self.plan.global_batch, self.config.seed)
        self.precision.load_state_dict(state["precision"])
        self._clock.restore(int(state["global_step"]))
        self._clock.stream.resumed(state.get("data"))
        self.trackers.resume_at(self.global_step)  # a run continued: its logs go on from this step

    def save_checkpoint(self, directory: str, model: nn.Module, optimizer: Any, scheduler: Any = None,
                        extra: dict[str, Any] | None = None, keep: int = 3, asynchronous: bool = False) -> Any:
        """Atomically write model, optimizer, scaler, scheduler, step (= data position) and every
        rank's RNG state to ``directory/step-XXXXXXXX.pt``; keep the newest ``keep``. Call on all ranks.
        ``scheduler`` defaults to the one given to :meth:`setup` or :meth:`register_scheduler`.
        ``asynchronous``: copy the state now, write it while training goes on (the next save and
        :meth:`close` wait for it); returns a future (:mod:`paratrain.checkpoint.asynchronous`)."""
        if self.micro_step:
            raise RuntimeError(f"checkpoint asked for in the middle of an accumulation (micro-step {self.micro_step}): "
                               "save after optimizer.step()")
        return checkpoint_lib.save_checkpoint(lock.held(self)(directory), self, *checkpointed(model, optimizer, self.unwrap),
                                              self.strategy, self._clock.checkpointed(scheduler), extra, keep, asynchronous)

    def load_checkpoint(self, source: str, model: nn.Module, optimizer: Any = None, scheduler: Any = None) -> Any:
        """Restore a run from a checkpoint file or a directory's newest good one (the loader continues mid-epoch): its ``extra``."""
        return checkpoint_lib.load_checkpoint(source, self, *checkpointed(model, optimizer, self.unwrap), self.strategy,
                                              self._clock.checkpointed(scheduler))

    def resume(self, directory: str | None, model: nn.Module, optimizer: Any = None, scheduler: Any = None, *,
               asked: bool = True, restarted: bool = False, refuse: Callable[[dict[str, Any]], str | None] | None = None
               ) -> dict[str, Any] | None:
        """Continue a run as ``paratrain train`` does (:func:`paratrain.checkpoint.resume`): its ``extra``, or None."""
        return checkpoint_lib.resume(lock.held(self)(directory), self, *checkpointed(model, optimizer, self.unwrap),
                                     self.strategy, self._clock.checkpointed(scheduler), asked=asked, restarted=restarted, refuse=refuse)

    @property
    def should_stop(self) -> bool:
        """True on every rank at one optimizer step once a stop signal (a preemption) reached any rank, after
        :meth:`save_on_stop`'s save; ask after ``optimizer.step()`` on every rank (:mod:`paratrain.env.preemption`)."""
        return self._stop.check(self.global_step, self.micro_step)

    def save_on_stop(self, directory: str, model: nn.Module, optimizer: Any, scheduler: Any = None,
                     extra: dict[str, Any] | Callable[[], dict[str, Any]] | None = None, keep: int = 3) -> None:
        """Register what :attr:`should_stop` saves (:meth:`save_checkpoint`'s arguments; ``extra`` may be
        a function, called then) when a stop signal ends the run, to continue from with :meth:`resume`."""
        self._stop.save = lambda: self.save_checkpoint(directory, model, optimizer, scheduler,
                                                       extra() if callable(extra) else extra, keep)

    def close(self, wait_for_peers: bool = True) -> None:
        """Finish the trackers, free the run's folders and end the process group paratrain made (one the script
        or Ray made stays theirs); by default after a barrier (``False`` after an error: runs marked failed)."""
        try:
            checkpoint_lib.finish_checkpoints(wait_for_peers)  # a checkpoint still written in the background
        finally:
            try:
                try:
                    self.trackers.close(ok=wait_for_peers)
                finally:
                    self.strategy.close(wait_for_peers)
                    lock.held(self).release()  # after the last write (a background checkpoint's, the trackers')
            finally:
                process.destroy(wait_for_peers)


Parallel.__doc__ = (Parallel.__doc__ or "").rstrip() + "\n" + ParallelConfig.options_help()  # each option's text: the config's own
