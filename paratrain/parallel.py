"""``Parallel``: the small API that takes a user's own training loop to N workers.

Seed 000's loop converts by changing a few lines::

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

from dataclasses import fields
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from . import precision as precision_lib
from . import strategies
from .config import ParallelConfig
from .data.batch import map_tensors, to_device
from .data.loaders import EvalLoader, GlobalBatchLoader
from .data.sampler import BatchPlan
from .env import process

__all__ = ["Parallel", "ParallelModule", "ParallelOptimizer"]


class ParallelOptimizer:
    """The user's optimizer, with ``step``/``zero_grad`` aware of accumulation and loss scaling.

    Everything else (``param_groups``, ``state_dict``...) is the wrapped optimizer's; pass
    ``.optimizer`` to LR schedulers.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: "Parallel") -> None:
        self.optimizer = optimizer
        self._runtime = runtime

    def step(self, closure: Any = None) -> bool:
        if closure is not None:
            raise ValueError("closures are not supported by paratrain's optimizer step: compute the loss in the loop")
        return self._runtime.step(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._runtime.micro_step == 0:  # never wipe gradients mid-accumulation
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class ParallelModule(nn.Module):
    """What :meth:`Parallel.setup` returns: the strategy's wrapper (DDP...) with forward run
    under the precision's autocast and floating outputs returned in fp32 (losses are computed
    outside the model). ``state_dict``/``load_state_dict`` are the user's module's, so
    checkpoints have the user's keys whatever the strategy.
    """

    def __init__(self, wrapped: nn.Module, original: nn.Module, precision: precision_lib.Precision,
                 before_forward: Callable[[nn.Module], None], after_load: Callable[[nn.Module], None]) -> None:
        super().__init__()
        self.module = wrapped
        object.__setattr__(self, "original", original)  # not a submodule: no duplicate keys
        object.__setattr__(self, "_precision", precision)
        object.__setattr__(self, "_before_forward", before_forward)
        object.__setattr__(self, "_after_load", after_load)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward(self.module)
        if not self._precision.autocast:
            return self.module(*args, **kwargs)
        with self._precision.forward_context():
            out = self.module(*args, **kwargs)
        return _to_float32(out)

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
    """

    def __init__(self, config: ParallelConfig | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise ValueError("pass either a ParallelConfig or keyword arguments, not both")
        known = {f.name for f in fields(ParallelConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown Parallel option {unknown[0]!r}: known options are {', '.join(sorted(known))}")
        self.config = cfg = config or ParallelConfig(**kwargs)
        self.dist = process.init(None if cfg.backend == "auto" else cfg.backend, cfg.timeout_s, cfg.accelerator)
        self.device = self.dist.device
        self.strategy = strategies.build(cfg, self.dist)
        self.precision = precision_lib.build(cfg.precision, self.device, cfg.loss_scale)
        self.strategy.precision = self.precision.name  # sharded strategies pick their param/reduce dtypes
        self.strategy.max_grad_norm = cfg.clip_grad_norm  # ps clips on the server
        self.precision.max_grad_norm = cfg.clip_grad_norm  # bf16-true/fp16-true clip their fp32 masters
        self.plan = BatchPlan.derive(cfg.global_batch, self.strategy.data_parallel_size, cfg.accumulation, cfg.micro_batch)
        # Same seed on every rank: identical initial weights, identical global data order.
        process.seed_everything(cfg.seed)
        self.global_step = 0
        self.micro_step = 0
        self._models: list[nn.Module] = []

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

    # --- model and optimizer ---------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Place and wrap ``model`` for the strategy and precision; wrap ``optimizer`` if given.

        Returns a :class:`ParallelModule` (or ``(module, optimizer)``). Parameters are kept (moved
        in place), so an optimizer built before ``setup`` stays valid.
        """
        original = model
        wrapped = self.strategy.setup_model(self.precision.setup_model(model))
        module = ParallelModule(wrapped, original, self.precision, self._before_forward, self._after_load)
        self._models.append(wrapped)
        if optimizer is None:
            return module
        optimizer = self.precision.setup_optimizer(self.strategy.setup_optimizer(wrapped, optimizer))
        return module, ParallelOptimizer(optimizer, self)

    def _after_load(self, module: nn.Module) -> None:
        self.precision.sync_from_model()
        self.strategy.sync_from_model(module)

    def _before_forward(self, wrapped: nn.Module) -> None:
        # Decide before DDP's forward whether this micro-step's backward all-reduces (no_sync).
        if self.accumulation > 1:
            self.strategy.set_gradient_sync(wrapped, self.micro_step == self.accumulation - 1)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module without paratrain/DDP/DataParallel wrappers (for saving or evaluation)."""
        if isinstance(model, ParallelModule):
            return model.original
        return self.strategy.unwrap(model)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state (unsharded, every pipeline stage) as CPU tensors. Collective."""
        return self.strategy.full_state_dict(self.unwrap(model))

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
        if callable(loss):
            loss(self.accumulation)
        else:
            self.precision.backward(loss / self.accumulation if self.accumulation > 1 else loss)
        self.micro_step += 1

    def training_step(self, model: nn.Module, batch: Any,
                      loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy) -> torch.Tensor:
        """``loss_fn(model(inputs), targets)`` and :meth:`backward`, the way the strategy runs them."""
        return self.strategy.training_step(model, batch, loss_fn, self.backward)

    def step(self, optimizer: torch.optim.Optimizer | ParallelOptimizer) -> bool:
        """Step at the end of a global batch (no-op on earlier micro-steps). True if weights changed."""
        if isinstance(optimizer, ParallelOptimizer):
            optimizer = optimizer.optimizer
        if self.micro_step < self.accumulation:
            return False
        clip = None
        if self.config.clip_grad_norm is not None:
            max_norm = self.config.clip_grad_norm
            clip = lambda: [self.strategy.clip_grad_norm(m, max_norm) for m in self._models]  # noqa: E731
        stepped = self.strategy.optimizer_step(optimizer, lambda: self.precision.step(optimizer, clip))
        optimizer.zero_grad(set_to_none=True)
        self.micro_step = 0
        self.global_step += 1
        return stepped

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because fp16 gradients overflowed."""
        return self.precision.skipped_steps

    # --- data ------------------------------------------------------------------------------
    def train_loader(self, dataset: Dataset, transform: Callable[..., torch.Tensor] | None = None,
                     shuffle: bool = True, **dataloader_kwargs: Any) -> GlobalBatchLoader:
        """Micro-batches of this rank, from the current global step, epoch after epoch.

        ``dataloader_kwargs`` go to :class:`torch.utils.data.DataLoader` (``num_workers``,
        ``pin_memory``, ``persistent_workers``...); batch size and sampler are paratrain's.
        """
        for k in ("batch_size", "sampler", "batch_sampler", "shuffle", "drop_last"):
            if k in dataloader_kwargs:
                raise ValueError(f"train_loader sets {k!r} itself from the global batch: remove it")
        if len(dataset) < self.plan.global_batch:  # type: ignore[arg-type]
            raise ValueError(
                f"the dataset has {len(dataset)} samples, fewer than one global batch of "  # type: ignore[arg-type]
                f"{self.plan.global_batch} over {self.world_size} processes: lower the global batch"
            )
        return GlobalBatchLoader(
            dataset, self.plan, self.strategy.data_parallel_rank, self.device, self.config.seed,
            position=lambda: self.global_step, transform=transform, shuffle=shuffle, **dataloader_kwargs,
        )

    def eval_loader(self, dataset: Dataset, batch_size: int | None = None,
                    transform: Callable[[torch.Tensor], torch.Tensor] | None = None, **dataloader_kwargs: Any) -> EvalLoader:
        """This rank's shard of an evaluation set: every sample exactly once across ranks."""
        return EvalLoader(dataset, batch_size or self.plan.micro_batch * self.accumulation,
                          self.strategy.data_parallel_size, self.strategy.data_parallel_rank, self.device,
                          transform, **dataloader_kwargs)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: EvalLoader,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """Mean loss and accuracy over the whole evaluation set, reduced over ranks.

        Data-parallel strategies run the unwrapped module, so no collective happens per batch and
        uneven shards cannot hang. Strategies whose forward is itself a collective (FSDP, tensor,
        pipeline) run the same number of forwards on every rank, padding with batches that are
        not counted. One all-reduce of (loss sum, correct, count) at the end.
        """
        net = self.unwrap(model)
        was_training = net.training
        net.eval()
        loss_fn = loss_fn or nn.functional.cross_entropy
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        for x, y, counted in self._eval_batches(loader):
            with self.precision.forward_context():
                out = self.strategy.eval_forward(net, x)
            if out is None or not counted:  # not the last pipeline stage, or a padding batch
                continue
            out = out.float()
            totals[0] += loss_fn(out, y).double() * len(y)
            totals[1] += (out.argmax(1) == y).sum()
            totals[2] += len(y)
        net.train(was_training)
        self.strategy.all_reduce_sum(totals)
        loss_sum, correct, count = totals.tolist()
        return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1), "count": int(count)}

    def _eval_batches(self, loader: EvalLoader) -> Any:
        if not self.strategy.collective_forward:
            yield from ((x, y, True) for x, y in loader)
            return
        n = torch.tensor([len(loader)], device=self.device)
        self.strategy.all_reduce_max(n)
        pad = None
        for x, y in loader:
            pad = (x[:1], y[:1], False)
            yield x, y, True
        if pad is None:  # an empty shard (more ranks than samples) still joins every forward
            x0, y0 = loader.dataloader.dataset[0]
            pad = (to_device(torch.as_tensor(x0)[None], self.device), to_device(torch.as_tensor(y0)[None], self.device), False)
        for _ in range(int(n.item()) - len(loader)):
            yield pad

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average of ``value`` over the data-parallel ranks."""
        value = value.detach().clone().float()
        return self.strategy.all_reduce_sum(value) / self.strategy.data_parallel_size

    # --- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, directory: str, model: nn.Module, optimizer: Any, scheduler: Any = None,
                        extra: dict[str, Any] | None = None, keep: int = 3) -> Any:
        """Atomically write model, optimizer, scaler, scheduler, step (= data position) and every
        rank's RNG state to ``directory/step-XXXXXXXX.pt``; keep the newest ``keep``. Call on all ranks."""
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, directory, model, optimizer, scheduler, extra, keep)

    def load_checkpoint(self, source: str, model: nn.Module, optimizer: Any = None, scheduler: Any = None) -> Any:
        """Restore a run from a checkpoint file or the newest loadable one in a directory; the
        next ``train_loader`` iteration continues mid-epoch. Returns ``extra`` (``None`` if none found)."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, source, model, optimizer, scheduler)

    def close(self, wait_for_peers: bool = True) -> None:
        """Leave the process group; by default after a barrier (pass ``False`` after an error)."""
        try:
            self.strategy.close(wait_for_peers)
        finally:
            process.destroy(wait_for_peers)


def _to_float32(out: Any) -> Any:
    """Floating tensors of a model's output in fp32; every container keeps its type."""
    return map_tensors(lambda t: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t, out)
