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
at the step boundary, so the loop body stays the same.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import asdict, fields
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from . import checkpoint as checkpoint_lib
from . import evaluation
from . import metrics as metrics_lib
from . import precision as precision_lib
from . import strategies
from . import tracking
from .config import ParallelConfig
from .data.from_loader import loader_samples
from .data.loaders import EvalLoader, GlobalBatchLoader
from .data.stream import StreamLoader
from .data.sampler import BatchPlan, check_dataset_fits
from .env import failures, process
from .env.provenance import provenance
from .metrics import batch_targets, model_loss, predictions
from .optim import GradientWatch, ParallelOptimizer, ParallelScheduler
from .precision.half import MasterWeights

# What train_loader keeps of a user's DataLoader (its sampler, batch size and drop_last are paratrain's;
# in_order too: batches out of order would make a step's samples depend on the workers' timing).
_KEPT_LOADER_SETTINGS = ("collate_fn", "num_workers", "pin_memory", "worker_init_fn", "persistent_workers", "timeout",
                         "prefetch_factor", "multiprocessing_context", "pin_memory_device")

__all__ = ["Parallel", "ParallelModule", "ParallelOptimizer", "ParallelScheduler"]


def _check_setup_arguments(model: Any, optimizer: Any, scheduler: Any) -> None:
    """setup(model, optimizer, scheduler) in that order and of those kinds, or a one-line error."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"setup: the model is a {type(model).__name__}, not a torch.nn.Module")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        hint = " (a scheduler? pass pt.setup(model, optimizer, scheduler))" if hasattr(optimizer, "optimizer") else ""
        raise TypeError(f"setup: the optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer{hint}")
    if scheduler is not None and not (callable(getattr(scheduler, "step", None)) and hasattr(scheduler, "optimizer")):
        raise TypeError(f"setup: the scheduler {scheduler!r} is not an LR scheduler (one with step() and an "
                        "optimizer, as torch.optim.lr_scheduler's)")


def _loader_settings(loader: DataLoader) -> dict[str, Any]:
    """The settings of a user's DataLoader that paratrain keeps (not its sampler or batch size)."""
    kept = {k: getattr(loader, k) for k in _KEPT_LOADER_SETTINGS if hasattr(loader, k)}
    if loader.num_workers == 0:  # DataLoader refuses these without workers
        kept.pop("prefetch_factor", None)
        kept.pop("persistent_workers", None)
    return kept


class ParallelModule(nn.Module):
    """What :meth:`Parallel.setup` returns: the strategy's wrapper (DDP...) with forward run
    under the precision's autocast and floating outputs returned in fp32 (losses are computed
    outside the model). ``state_dict``/``load_state_dict`` are the user's module's, so
    checkpoints have the user's keys whatever the strategy, and so is ``.module`` (as Lightning
    Fabric's): a DDP script's ``model.module.state_dict()`` or ``model.module.save_pretrained(...)``
    means the same at every world size (under fsdp/tensor that module holds sharded parameters:
    use :meth:`Parallel.full_state_dict`).
    """

    def __init__(self, wrapped: nn.Module, original: nn.Module, precision: precision_lib.Precision,
                 before_forward: Callable[[nn.Module], None], after_load: Callable[[nn.Module], None],
                 strategy_module: nn.Module | None = None, checkpointed: nn.Module | None = None) -> None:
        super().__init__()
        self._forward_module = wrapped  # what forward runs: the strategy's wrapper, compiled if asked
        object.__setattr__(self, "original", original)  # not a submodule: no duplicate keys
        object.__setattr__(self, "_strategy_module", wrapped if strategy_module is None else strategy_module)
        object.__setattr__(self, "_checkpointed", original if checkpointed is None else checkpointed)
        object.__setattr__(self, "_precision", precision)
        object.__setattr__(self, "_before_forward", before_forward)
        object.__setattr__(self, "_after_load", after_load)

    @property
    def module(self) -> nn.Module:
        """The user's module (not DDP or another strategy wrapper, whatever the world size)."""
        return self.__dict__["original"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward(self._strategy_module)
        if not self._precision.autocast:
            return self._forward_module(*args, **kwargs)
        with self._precision.forward_context():
            out = self._forward_module(*args, **kwargs)
        return evaluation.to_float32(out)

    def checkpointed_module(self) -> nn.Module:
        """The module whose parameters this rank holds and checkpoints (a pipeline's stage, the
        user's module otherwise); what :mod:`paratrain.checkpoint` saves and loads."""
        return self._checkpointed

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.original.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the user's module; fp32 master weights and a parameter server's copy follow."""
        result = self.original.load_state_dict(state_dict, strict=strict, assign=assign)
        self._after_load(self.original)
        return result

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["original"], name)  # the user's own attributes


class Parallel:
    """Process setup + strategy + precision + global-batch data, for a loop the user writes.

    Pass a :class:`~paratrain.config.ParallelConfig`, or its fields as keyword arguments.
    ``log_to`` (``["csv", "tensorboard", "wandb", "mlflow"]``, or ``"csv,wandb"``) and ``loggers``
    (:class:`~paratrain.tracking.Tracker` instances) are where :meth:`log` writes, into
    ``log_dir`` (default: a new ``runs/<start time>``), on the main process only.
    """

    def __init__(self, config: ParallelConfig | None = None, *, log_to: str | Iterable[str] | None = None,
                 log_dir: str | None = None, loggers: Iterable[tracking.Tracker] = (), **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise ValueError("pass either a ParallelConfig or keyword arguments, not both")
        known = {f.name for f in fields(ParallelConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown Parallel option {unknown[0]!r}: known options are {', '.join(sorted(known))}")
        self.config = cfg = config or ParallelConfig(**kwargs)
        self.dist = process.init(None if cfg.backend == "auto" else cfg.backend, cfg.timeout_s, cfg.accelerator)
        self.device = self.dist.device
        if self.dist.backend is not None:
            failures.explain_uncaught()  # a failed collective in this loop ends with its one-line cause
        self.strategy = strategies.build(cfg, self.dist)
        self.precision = precision_lib.build(cfg.precision, self.device, cfg.loss_scale)
        self.precision.max_grad_norm = cfg.clip_grad_norm  # bf16-true/fp16-true clip their fp32 masters
        self.plan = BatchPlan.derive(cfg.global_batch, self.strategy.data_parallel_size, cfg.accumulation, cfg.micro_batch)
        # Same seed on every rank: identical initial weights, identical global data order.
        process.seed_everything(cfg.seed)
        self.global_step = 0
        self.micro_step = 0
        self._masters_from_model = False  # see load_state_dict
        self._scaler_skips = 0  # global batches the loop's own GradScaler skipped (see scaled_step)
        self._models: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []  # the real ones, as the strategy/precision made them
        self._schedulers: list[Any] = []  # given to setup or register_scheduler: checkpointed by default
        self._auto_schedulers: list[tuple[Any, torch.optim.Optimizer]] = []  # stepped by paratrain
        self._lrs_at_start: list[float] | None = None
        self._warned_lr_change = False
        self._grad_watch = GradientWatch()  # gradients edited mid-accumulation (a clip in the loop body)
        # Several optimizers (see step): those that stepped since the last backward, those whose
        # step() came before their global batch ended, and those that ended one in this global step.
        self._stepped_since_backward: list[torch.optim.Optimizer] = []
        self._early: list[torch.optim.Optimizer] = []
        self._ended_this_step: list[torch.optim.Optimizer] = []
        # checked on every rank (a bad name fails everywhere alike); opened on the main process only
        self.trackers = tracking.Trackers(log_to, log_dir, loggers, enabled=self.is_main_process, config=self._run_config)

    # --- who am I --------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def is_main_process(self) -> bool:
        return self.dist.is_main_process

    @property
    def accumulation(self) -> int:
        return self.plan.accumulation

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    # --- tracking --------------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], step: int | None = None, kind: str = "train") -> None:
        """Record ``metrics`` (numbers or one-element tensors) at ``step`` (default: the optimizer
        steps taken, ``global_step``) with every tracker of ``log_to``/``loggers``, as
        ``<kind>/<name>`` (CSV: a row of ``<log_dir>/<kind>.csv``). Main process only: elsewhere,
        and without trackers, nothing happens. The first call starts the backends' runs, with
        this job's parallel config and provenance as their config."""
        self.trackers.log(metrics, self.global_step if step is None else int(step), kind)

    def _run_config(self) -> dict[str, Any]:
        return {"parallel": asdict(self.config),
                "provenance": provenance({"world_size": self.world_size, "data_parallel_size": self.plan.world_size,
                                          "strategy": self.config.strategy, "backend": self.dist.backend,
                                          "device": str(self.device)})}

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
        _check_setup_arguments(model, optimizer, scheduler)
        compiled = model if _is_compiled(model) else None
        original = _uncompiled(model)  # its keys are the checkpoint's, compiled or not
        wrapped = self.strategy.adopt(original)  # a wrapper the user made (their DDP) is kept
        if wrapped is not None:
            if self.precision.name in precision_lib.MASTER_WEIGHTS:
                raise ValueError(f"precision {self.precision.name} converts the model's weights: pass the plain module "
                                 f"to setup, not one already wrapped in {type(wrapped).__name__}")
            original = self.strategy.unwrap(wrapped)
        else:
            wrapped = self.strategy.setup_model(self.precision.setup_model(original))
            if isinstance(self.precision, MasterWeights):
                self.precision.broadcast_masters()  # the model now holds rank 0's weights: so do the masters
        runner = wrapped
        if compiled is not None:  # compiled by the user: the same compilation, around the strategy's wrapper
            runner = type(compiled)(wrapped, compiled.dynamo_ctx)
        elif self.config.compile:
            runner = torch.compile(wrapped, backend=self.config.compile_backend)  # type: ignore[assignment]
        module = ParallelModule(runner, original, self.precision, self._before_forward, self._after_load, wrapped,
                                self.strategy.checkpoint_module(wrapped, original))
        self._models.append(wrapped)
        if optimizer is None:
            if scheduler is not None:
                raise ValueError("setup got a scheduler but no optimizer: pass both, pt.setup(model, optimizer, scheduler)")
            return module
        wrapped_optimizer = self.setup_optimizer(optimizer, module, scheduler)
        return (module, *wrapped_optimizer) if scheduler is not None else (module, wrapped_optimizer)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None,
                        scheduler: Any = None) -> Any:
        """One more optimizer for a model already set up (default: the last one), e.g. SparseAdam
        for the embeddings and AdamW for the rest; step each after the same backward, as in a plain
        loop. Returns the optimizer, or ``(optimizer, scheduler)``, as :meth:`setup` does."""
        if not self._models:
            raise ValueError("setup_optimizer: set the model up first, model = pt.setup(model)")
        wrapped = self._models[-1] if model is None else getattr(model, "_strategy_module", None)
        if wrapped is None or not any(wrapped is m for m in self._models):
            raise ValueError("setup_optimizer: pass the model pt.setup returned (or none: the last one set up)")
        inner = self.precision.setup_optimizer(self.strategy.setup_optimizer(wrapped, optimizer))
        self._optimizers.append(inner)
        wrapped_optimizer = ParallelOptimizer(inner, self)
        if scheduler is None:
            return wrapped_optimizer
        wrapped_scheduler = ParallelScheduler(self._attach(scheduler, wrapped_optimizer), self)
        self._schedulers.append(wrapped_scheduler)
        return wrapped_optimizer, wrapped_scheduler

    def register_scheduler(self, scheduler: Any, optimizer: ParallelOptimizer | None = None) -> Any:
        """Let paratrain step ``scheduler`` after every optimizer step (don't call its ``step()``
        yourself). Built on the optimizer from :meth:`setup`, or on the one passed to it (then
        pass the returned optimizer as ``optimizer``). It goes into checkpoints by default."""
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError("register_scheduler: ReduceLROnPlateau steps on a metric that paratrain does not have: "
                             "pass it to pt.setup(model, optimizer, scheduler) and call scheduler.step(metric) yourself")
        if optimizer is None:
            optimizer = getattr(scheduler, "optimizer", None)
            if not isinstance(optimizer, ParallelOptimizer):
                raise ValueError("register_scheduler: build the scheduler on the optimizer pt.setup returned, "
                                 "or pass that optimizer: pt.register_scheduler(scheduler, optimizer)")
        scheduler = self._attach(scheduler, optimizer)
        self._auto_schedulers.append((scheduler, optimizer.optimizer))
        self._schedulers.append(scheduler)
        return scheduler

    @staticmethod
    def _attach(scheduler: Any, optimizer: ParallelOptimizer) -> Any:
        """Point ``scheduler`` (and those a SequentialLR/ChainedScheduler holds) at ``optimizer``."""
        for s in (scheduler, *getattr(scheduler, "_schedulers", ())):
            if hasattr(s, "optimizer"):
                s.optimizer = optimizer
        return scheduler

    def _after_load(self, module: nn.Module) -> None:
        self.precision.sync_from_model()
        self.strategy.sync_from_model(module)

    def _before_forward(self, wrapped: nn.Module) -> None:
        # Decide before DDP's forward whether this micro-step's backward all-reduces (no_sync).
        if self.accumulation > 1:
            self.strategy.set_gradient_sync(wrapped, self.micro_step == self.accumulation - 1)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module without paratrain/DDP/DataParallel wrappers (for saving or evaluation)."""
        model = _uncompiled(model)
        if isinstance(model, ParallelModule):
            return model.original
        return _uncompiled(self.strategy.unwrap(model))

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state (unsharded, every pipeline stage) as CPU tensors. Collective."""
        return self.strategy.full_state_dict(self.unwrap(model))

    def save_pretrained(self, model: nn.Module, directory: str | os.PathLike[str], **kwargs: Any) -> None:
        """``save_pretrained(directory, **kwargs)`` of a HuggingFace model (anything with that
        method) under any strategy: the whole state gathered (:meth:`full_state_dict`), written by
        the main process. Collective: call it on every rank. (Under fsdp/tensor the module's own
        ``save_pretrained`` would meet sharded parameters.)"""
        user = self.unwrap(model)
        save = getattr(user, "save_pretrained", None)
        if not callable(save):
            raise TypeError(f"save_pretrained: {type(user).__name__} has no save_pretrained method; save "
                            "pt.full_state_dict(model) instead, e.g. with paratrain.save_on_main")
        state = self.full_state_dict(model)
        if self.is_main_process:
            save(directory, state_dict=state, **kwargs)
        process.barrier()

    # --- the step --------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor | Callable[[int], None]) -> None:
        """Backward of one micro-batch's loss (averaged over the accumulation steps).

        A strategy whose schedule runs backward itself (pipeline) passes a callable instead: it is
        called with the divisor (the accumulation steps) its losses must be divided by.
        """
        if self.micro_step >= self.accumulation:
            raise RuntimeError(
                f"backward called {self.micro_step + 1} times without an optimizer step, but accumulation "
                f"is {self.accumulation}: call optimizer.step() once per micro-batch"
            )
        if self.micro_step == 0 and self.accumulation > 1:
            self._lrs_at_start = self._current_lrs()
        self._stepped_since_backward = []
        if callable(loss):
            loss(self.accumulation)
        else:
            watch = self.accumulation > 1
            if watch and self.micro_step > 0:
                self._grad_watch.check(self.accumulation, self.micro_step)
            self.precision.backward(loss / self.accumulation if self.accumulation > 1 else loss)
            if watch and self.micro_step < self.accumulation - 1:
                self._grad_watch.record(p for m in self._models for p in m.parameters())
        self.micro_step += 1

    def training_step(self, model: nn.Module, batch: Any,
                      loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy) -> torch.Tensor:
        """``loss_fn(model(inputs), targets)`` and :meth:`backward`, the way the strategy runs them.

        A dict batch runs ``model(**batch)`` and uses the model's own loss (HuggingFace's, when the
        batch has ``labels``), else ``loss_fn(logits, batch["labels"])``."""
        if isinstance(batch, Mapping):
            out = model(**batch)
            loss = model_loss(out)
            if loss is None:
                loss = loss_fn(predictions(out), batch_targets(batch))
            self.backward(loss)
            return loss
        return self.strategy.training_step(model, batch, loss_fn, self.backward)

    def step(self, optimizer: torch.optim.Optimizer | ParallelOptimizer) -> bool:
        """Step at the end of a global batch (no-op on earlier micro-steps). True if weights changed.

        Several optimizers work as in a plain loop: each stepping after the same backward (one per
        parameter group or model, ``opt_a.step(); opt_b.step()``), or each after a backward of its
        own (a GAN's discriminator and generator, one global step per round; accumulation 1)."""
        if isinstance(optimizer, ParallelOptimizer):
            optimizer = optimizer.optimizer
        if self.micro_step < self.accumulation:
            if self.micro_step == 0 and self._stepped_since_backward and optimizer not in self._stepped_since_backward:
                return self._step_another(optimizer)
            if self.micro_step > 0 and optimizer not in self._early:
                self._early.append(optimizer)
            return False
        if self._early and optimizer not in self._early:
            raise ValueError(
                f"two optimizers step after backward calls of their own (a GAN-style loop) with accumulation "
                f"{self.accumulation}: the one that stepped first would never step; use accumulation 1 "
                "(a larger micro-batch), or one optimizer for both losses")
        clip = None
        if self.config.clip_grad_norm is not None:
            max_norm = self.config.clip_grad_norm
            clip = lambda: [self.strategy.clip_grad_norm(m, max_norm) for m in self._models]  # noqa: E731
        self._check_lr_unchanged()
        stepped = self.strategy.optimizer_step(optimizer, lambda: self.precision.step(optimizer, clip))
        self._end_global_batch(optimizer)
        return stepped

    def _end_global_batch(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step of a global batch (taken or skipped): gradients cleared, the
        data position one step on, and the schedulers paratrain steps for ``optimizer`` stepped.

        With several optimizers that each end a batch of their own (a GAN), the global step (the
        data position) moves once per round: when an optimizer ends a batch again."""
        self._after_step(optimizer)
        self.micro_step = 0
        self._early = []
        self._stepped_since_backward = [optimizer]
        if not self._ended_this_step or optimizer in self._ended_this_step:
            self.global_step += 1
            self._ended_this_step = []
        self._ended_this_step.append(optimizer)

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        for scheduler, owner in self._auto_schedulers:
            if owner is optimizer:
                scheduler.step()

    def _step_another(self, optimizer: torch.optim.Optimizer) -> bool:
        """The step of a second optimizer after the same backward as the one that ended the global
        batch: its gradients are complete (and clipped with the others' by that step)."""
        if isinstance(self.precision, (precision_lib.FP16Mixed, MasterWeights)):
            raise ValueError(f"two optimizers stepping after one backward under precision {self.precision.name}: its "
                             "loss scale or master weights follow one optimizer; use one optimizer with a parameter "
                             "group each, or precision bf16-mixed or 32")
        stepped = self.strategy.optimizer_step(optimizer, lambda: self.precision.step(optimizer, None))
        self._after_step(optimizer)
        self._stepped_since_backward.append(optimizer)
        return stepped

    def scaled_step(self, optimizer: ParallelOptimizer, found_inf: torch.Tensor, grad_scale: Any) -> bool:
        """:meth:`step` as the loop's own ``torch.amp.GradScaler`` drives it: ``scaler.step(optimizer)``
        calls ``optimizer.step()`` every time, with ``found_inf`` and ``grad_scale`` (``None`` when
        the loop called ``scaler.unscale_`` itself) set on it. Inf/NaN gradients end the global
        batch as a skipped step (as paratrain's fp16 skips one: the data moves on, a registered
        scheduler steps); else the gradients are unscaled and the optimizer steps."""
        if self.accumulation > 1:
            raise ValueError(
                f"your own GradScaler with accumulation {self.accumulation}: its step() and update() every "
                "micro-batch would unscale and rescale gradients in the middle of a global batch; drop it and "
                "use Parallel(precision='fp16-mixed'), which scales the loss and skips overflow steps per global batch")
        inner = optimizer.optimizer
        if self.micro_step < self.accumulation:
            return False
        if bool(found_inf.item()):
            self._scaler_skips += 1
            self._end_global_batch(inner)
            return False
        if grad_scale is not None:
            inv = 1.0 / grad_scale.double()
            for group in inner.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv.to(device=p.grad.device, dtype=p.grad.dtype))
        return self.step(inner)

    def _current_lrs(self) -> list[float]:
        return [float(g["lr"]) for opt in self._optimizers for g in opt.param_groups if "lr" in g]

    def _check_lr_unchanged(self) -> None:
        """Warn once when the lr moved between the micro-steps of one global batch: a scheduler
        stepped per micro-batch instead of per optimizer step."""
        if self._lrs_at_start is not None and not self._warned_lr_change and self._current_lrs() != self._lrs_at_start:
            self._warned_lr_change = True
            warnings.warn("the learning rate changed in the middle of an accumulation: a scheduler steps per "
                          "micro-batch; pass it to pt.setup(model, optimizer, scheduler) or pt.register_scheduler",
                          stacklevel=3)
        self._lrs_at_start = None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed (paratrain's loss scaling, or
        the loop's own ``GradScaler``: see :meth:`scaled_step`)."""
        return self.precision.skipped_steps + self._scaler_skips

    # --- data ------------------------------------------------------------------------------
    def train_loader(self, dataset: Dataset | DataLoader, transform: Callable[..., torch.Tensor] | None = None,
                     shuffle: bool | None = None, **dataloader_kwargs: Any) -> GlobalBatchLoader | StreamLoader:
        """Micro-batches of this rank, from the current global step, epoch after epoch.

        ``dataset`` is a dataset, or your own :class:`~torch.utils.data.DataLoader`: its dataset,
        ``collate_fn``, ``num_workers``, ``pin_memory``, ``worker_init_fn``, ``persistent_workers``
        (and prefetch/timeout/multiprocessing settings) are kept, its sampler and batch size are
        replaced by paratrain's global-batch sampler over the samples its sampler selects (a
        ``SubsetRandomSampler``'s part of the dataset; one that draws samples twice is refused),
        and a ``batch_size`` other than the derived micro-batch is reported in one line.
        ``shuffle`` defaults to True, or for a DataLoader to whether its sampler was random.
        ``dataloader_kwargs`` go to the DataLoader and win over a given loader's settings; batch
        size and sampler are paratrain's.

        An :class:`~torch.utils.data.IterableDataset` (a stream of unknown length, or a
        :class:`~paratrain.data.stream.ShardedStream` of files) gives the same global batches at
        any world size and the same number of steps on every rank (see :mod:`paratrain.data.stream`).
        """
        for k in ("batch_size", "sampler", "batch_sampler", "drop_last"):
            if k in dataloader_kwargs:
                raise ValueError(f"train_loader sets {k!r} itself from the global batch: remove it")
        data: Dataset = dataset  # type: ignore[assignment]
        if isinstance(dataset, DataLoader):
            data, kept, shuffle = self._from_dataloader(dataset, shuffle)
            dataloader_kwargs = {**kept, **dataloader_kwargs}
        if isinstance(data, IterableDataset):
            if transform is not None or shuffle:
                raise ValueError("a stream (IterableDataset) is read in order, without transform: shuffle or "
                                 "augment inside the dataset")
            return StreamLoader(data, self.plan, self.strategy.data_parallel_rank, self.device, self._min_all,
                                position=lambda: self.global_step, **dataloader_kwargs)
        shuffle = True if shuffle is None else shuffle
        check_dataset_fits(len(data), self.plan.global_batch, f" over {self.world_size} processes")  # type: ignore[arg-type]
        return GlobalBatchLoader(
            data, self.plan, self.strategy.data_parallel_rank, self.device, self.config.seed,
            position=lambda: self.global_step, transform=transform, shuffle=shuffle, **dataloader_kwargs,
        )

    def _min_all(self, n: int) -> int:
        """The smallest ``n`` over all ranks (a collective)."""
        t = torch.tensor([-n], dtype=torch.int64, device=self.device)
        self.strategy.all_reduce_max(t)
        return -int(t.item())

    def _from_dataloader(self, loader: DataLoader, shuffle: bool | None) -> tuple[Any, dict[str, Any], bool | None]:
        """The dataset and settings of a user's DataLoader that paratrain keeps, and its shuffle."""
        kept = _loader_settings(loader)
        m = self.plan
        if loader.batch_size is not None and loader.batch_size != m.micro_batch:
            warnings.warn(f"train_loader: the DataLoader's batch_size {loader.batch_size} is replaced by the micro-batch "
                          f"{m.micro_batch} (global batch {m.global_batch} = {m.micro_batch} × {m.world_size} processes "
                          f"× {m.accumulation} accumulation steps)", stacklevel=3)
        dataset, random_order = loader_samples(loader, "train_loader")
        if shuffle is None and not isinstance(dataset, IterableDataset):
            shuffle = random_order
            if random_order is None:
                sampler = loader.sampler if loader.batch_size is not None else loader.batch_sampler
                warnings.warn(f"train_loader: the DataLoader's {type(sampler).__name__} is replaced by paratrain's "
                              "global-batch sampler over the samples it gives (shuffled: pass shuffle=False for their "
                              "order)", stacklevel=3)
        return dataset, kept, shuffle

    def eval_loader(self, dataset: Dataset | DataLoader, batch_size: int | None = None,
                    transform: Callable[[torch.Tensor], torch.Tensor] | None = None, **dataloader_kwargs: Any) -> EvalLoader:
        """This rank's shard of an evaluation set: every sample exactly once across ranks.

        ``dataset`` may be your own :class:`~torch.utils.data.DataLoader`: its dataset (the part its
        sampler selects), batch size, ``collate_fn`` and worker settings are kept, its sampler is
        replaced by this rank's shard.
        """
        if isinstance(dataset, DataLoader):
            loader = dataset
            dataloader_kwargs = {**_loader_settings(loader), **dataloader_kwargs}
            dataset, batch_size = loader_samples(loader, "eval_loader")[0], batch_size or loader.batch_size
        return EvalLoader(dataset, batch_size or self.plan.micro_batch * self.accumulation,
                          self.strategy.data_parallel_size, self.strategy.data_parallel_rank, self.device,
                          transform, **dataloader_kwargs)

    def evaluate(self, model: nn.Module, loader: EvalLoader, loss_fn: Callable[..., torch.Tensor] | None = None,
                 *, step_fn: Callable[[nn.Module, Any], Any] | None = None,
                 metrics: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Loss, accuracy (classification only) and your metrics over the whole evaluation set,
        reduced over ranks; ``count`` is the number of samples.

        How a batch becomes predictions and targets:

        * ``step_fn(model, batch)``, if given, returns the batch's mean loss (a scalar tensor)
          or ``(predictions, targets)``;
        * a dict batch is passed as ``model(**batch)``: the output's ``loss`` (HuggingFace
          computes it when the batch has ``labels``) and ``logits`` are used, ``batch["labels"]``
          (or ``"label"``) are the targets;
        * ``(inputs, targets)``: ``model(inputs)``.

        The loss is ``loss_fn(predictions, targets)`` if given, else the model's own, else
        cross-entropy for classification targets (integers, with logits that have a class
        dimension) or mean squared error for float targets of the predictions' shape. ``accuracy``
        is reported only for classification targets. ``metrics`` maps names to functions
        ``fn(predictions, targets)`` returning the batch's mean (averaged over samples), or to
        objects with ``update``/``compute`` (torchmetrics ``Metric``: they sync themselves).

        Data-parallel strategies run the unwrapped module, so no collective happens per batch and
        uneven shards cannot hang. Strategies whose forward is itself a collective (FSDP, tensor,
        pipeline) run the same number of forwards on every rank, padding with batches that are
        not counted. One all-reduce of the sums at the end.
        """
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
                "world_size": self.world_size, "precision": self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_dict` of a run with the same global batch; the
        world size may differ)."""
        if state["global_batch"] != self.plan.global_batch:
            raise ValueError(f"was written with global batch {state['global_batch']}, this run uses "
                             f"{self.plan.global_batch}: resume with the same global batch (the world size may change)")
        if state.get("seed") is not None and int(state["seed"]) != self.config.seed:  # the epoch's order is the seed's
            raise ValueError(f"was written with seed {state['seed']}, this run uses {self.config.seed}: resume with "
                             "the same seed (the rest of the epoch would repeat some samples and skip others)")
        self.precision.load_state_dict(state["precision"])
        # Written in a precision without fp32 masters (32, *-mixed) and resumed in bf16-true/fp16-true:
        # the masters must start from the loaded weights, which the model gets after this (load_checkpoint).
        self._masters_from_model = "masters" not in state["precision"]
        self.global_step, self.micro_step = int(state["global_step"]), 0

    def _checkpointed(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        """The module and the plain optimizer that this rank checkpoints."""
        model = _uncompiled(model)
        module = model.checkpointed_module() if isinstance(model, ParallelModule) else self.unwrap(model)
        return module, getattr(optimizer, "optimizer", optimizer)

    def save_checkpoint(self, directory: str, model: nn.Module, optimizer: Any, scheduler: Any = None,
                        extra: dict[str, Any] | None = None, keep: int = 3) -> Any:
        """Atomically write model, optimizer, scaler, scheduler, step (= data position) and every
        rank's RNG state to ``directory/step-XXXXXXXX.pt``; keep the newest ``keep``. Call on all ranks.
        ``scheduler`` defaults to the one given to :meth:`setup` or :meth:`register_scheduler`."""
        if self.micro_step:
            raise RuntimeError(f"checkpoint asked for in the middle of an accumulation (micro-step {self.micro_step}): "
                               "save after optimizer.step()")
        return checkpoint_lib.save_checkpoint(directory, self, *self._checkpointed(model, optimizer), self.strategy,
                                              self._scheduler(scheduler), extra, keep)

    def load_checkpoint(self, source: str, model: nn.Module, optimizer: Any = None, scheduler: Any = None) -> Any:
        """Restore a run from a checkpoint file or the newest loadable one in a directory; the
        next ``train_loader`` iteration continues mid-epoch. Returns ``extra`` (``None`` if none found)."""
        self._masters_from_model = False
        extra = checkpoint_lib.load_checkpoint(source, self, *self._checkpointed(model, optimizer), self.strategy,
                                               self._scheduler(scheduler))
        if self._masters_from_model:
            self.precision.sync_from_model()
        if extra is not None:  # a run continued: its logs go on from this step
            self.trackers.resume_at(self.global_step)
        for s in self._schedulers:
            if isinstance(s, ParallelScheduler):
                s._stepped_at = self.global_step  # the restored step is the one it last stepped on
        return extra

    def _scheduler(self, scheduler: Any) -> Any:
        if scheduler is not None or not self._schedulers:
            return scheduler
        if len(self._schedulers) > 1:
            raise ValueError(f"{len(self._schedulers)} schedulers were set up: pass the one to checkpoint as scheduler=")
        return self._schedulers[0]

    def close(self, wait_for_peers: bool = True) -> None:
        """Finish the trackers and leave the process group; by default after a barrier (pass
        ``False`` after an error: the trackers' runs are marked failed)."""
        try:
            try:
                self.trackers.close(ok=wait_for_peers)
            finally:
                self.strategy.close(wait_for_peers)
        finally:
            process.destroy(wait_for_peers)


def _is_compiled(model: Any) -> bool:
    """Is ``model`` ``torch.compile``'s wrapper? (torch._dynamo is loaded once anything was compiled:
    no import here, which would cost seconds in every process.)"""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def _uncompiled(model: Any) -> Any:
    """``model`` without ``torch.compile``'s wrapper (whose state_dict keys start with ``_orig_mod.``)."""
    while _is_compiled(model):
        model = model._orig_mod
    return model
