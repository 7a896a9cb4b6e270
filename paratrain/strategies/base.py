"""The strategy interface: how a model is placed and wrapped, and how gradients meet."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, ClassVar, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.sharded import full_state_dict as sharded_full_state_dict
from ..env.process import Dist
from ..metrics import predictions
from ..nn.checkpointing import apply_activation_checkpointing
from ..nn.deferred import Held
from ..nn.syncbn import convert_sync_batchnorm
from ..precision import Precision, computes_in_fp32, lookup as precision_class
from ..precision.base import Stepped

__all__ = ["Strategy", "NotApplicable", "data_parallel_size"]


def mesh_dimensions(mesh: Any, names: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each dimension's process group name of a ``DeviceMesh`` -> the layout's name for it (``names``
    renames the mesh's own, e.g. ``{"dp": "dp_shard"}``); None: no mesh yet."""
    if mesh is None:
        return {}
    names = names or {}
    return {str(mesh.get_group(d).group_name): names.get(d, d) for d in mesh.mesh_dim_names}


def data_parallel_size(sizes: Mapping[str, int]) -> int:
    """The data shards of a layout (mesh sizes, :mod:`.mesh`): the batch is split over ``dp_replicate x
    dp_shard`` ranks; the ``pp`` stages of a pipeline and the ``tp`` ranks of a group read the same samples."""
    return sizes.get("dp_replicate", 1) * sizes.get("dp_shard", 1)


class NotApplicable(ValueError):
    """This strategy cannot run this model (or batch) as configured: no Linear pair to split, a
    forward that is not its children in order... ``paratrain bench`` shows such a cell as skipped;
    any other error of a cell is a failure."""


class Strategy:
    """One way of parallelizing. Subclasses override :meth:`wrap` (and the sync hooks if needed).

    ``data_parallel_size``/``data_parallel_rank`` tell the data layer how to shard batches;
    ``processes`` says how many processes the strategy expects (``None``: any). A strategy is built
    with its :class:`~paratrain.precision.Precision` and asks it (as Lightning Fabric's does): how
    the model is cast and the optimizer stepped, and the dtypes of sharded parameters.
    """

    name: ClassVar[str] = "base"
    processes: ClassVar[str] = "any"  # "one": the whole job is one process; "any"
    drives_all_local_devices: ClassVar[bool] = False  # one process uses every GPU it sees (dp)
    collective_forward: ClassVar[bool] = False  # does forward itself communicate (FSDP, TP, pipeline)?
    sharded_state: ClassVar[bool] = False  # checkpoint through torch.distributed.checkpoint (FSDP, TP)?
    stage_per_process: ClassVar[bool] = False  # one consecutive part of the model per process (pipeline)?
    master_weights: ClassVar[bool] = False  # bf16-true/fp16-true: low-precision model + fp32 masters in the optimizer
    master_weights_hint: ClassVar[str] = "bf16-mixed or 32"  # what to use instead when master_weights is False
    local_overflow_skip: ClassVar[bool] = True  # fp16-mixed: can a rank skip an overflowing step without the others?
    # each process runs every layer whole, once (not split over processes, not copied per device, no server): what
    # fp8-mixed's Float8Linear layers need, and the language-model rows of selftest run
    whole_layers: ClassVar[bool] = False
    in_process_micro_batches: ClassVar[bool] = False  # can options.micro_batches pipeline parts inside one process?
    reference: ClassVar[bool] = False  # the one-device run the others are checked against (bench speedups, verify)
    plain_data_parallel: ClassVar[bool] = False  # a replica per process, gradients all-reduced: the multi-process reference
    comm_hooks: ClassVar[tuple[str, ...]] = ()  # what options.comm_hook accepts (DDP gradient compression); (): no hooks
    bench_default: ClassVar[str] = "full"  # in paratrain bench's default matrices: "quick" (and full), "full", "no"
    options_class: ClassVar[type | None] = None  # the dataclass of its [parallel.<name>] config section; None: none
    def __init__(self, dist_info: Dist, sync_batchnorm: bool = False, options: Any = None, *,
                 precision: Precision | None = None, max_grad_norm: float | None = None,
                 activation_checkpointing: Any = None, layout: dict[str, int] | None = None) -> None:
        """``dist_info``: this process's place in the job; ``options``: the strategy's own section
        of the config; ``precision``: the run's precision (default: plain fp32, changing no setting);
        ``max_grad_norm``: clip_grad_norm (ps clips on its server); ``activation_checkpointing``:
        the blocks to checkpoint (:mod:`paratrain.nn.checkpointing`), applied before wrapping."""
        self.proc = dist_info
        self.activation_checkpointing = activation_checkpointing
        self.precision = precision if precision is not None else Precision(dist_info.device)
        self.max_grad_norm = max_grad_norm
        self.device = dist_info.device
        self.sync_batchnorm = sync_batchnorm
        self.options = options
        self.check_world(dist_info.world_size)
        # the mesh sizes this process is part of (ParallelConfig.layout: the mesh given, else the shorthand's)
        self.layout = layout if layout is not None else self.layout_for(dist_info.world_size, options)

    # --- what the strategy can run (asked before any process starts) -----------------------
    @classmethod
    def validate(cls, cfg: Any) -> None:
        """Refuse a ``ParallelConfig`` this strategy cannot run, in one line naming the fix."""
        precision = precision_class(cfg.precision)
        if precision.master_weights and not cls.master_weights:
            raise ValueError(f"precision {cfg.precision} (low-precision weights with fp32 master copies) is not "
                             f"supported with strategy {cls.name}: use {cls.master_weights_hint}")
        if precision.float8 and not cls.whole_layers:  # names the strategies that declare it (a test keeps them so)
            raise ValueError(f"precision {cfg.precision} (torchao's Float8 linears) is not supported with strategy "
                             f"{cls.name}: use single, ddp or fsdp")
        if precision.scales_loss and not cls.local_overflow_skip:
            raise ValueError(f"precision {cfg.precision} is not supported with strategy {cls.name} (each rank would "
                             "skip overflowing steps on its own): use bf16-mixed or 32")

    @classmethod
    def check_world(cls, world: int) -> None:
        """Refuse a world of ``world`` processes that this strategy cannot run on, in one line."""
        if cls.processes == "one" and world > 1:
            raise ValueError(f"strategy {cls.name!r} runs in one process, but {world} were asked for: "
                             "use --strategy ddp, or drop --nproc-per-node/--nnodes")

    @classmethod
    def options_of(cls, cfg: Any) -> Any:
        """What this strategy is built with from a ``ParallelConfig``: its own section (``cfg.ddp``...)."""
        return getattr(cfg, cls.name, None)

    @classmethod
    def data_parallel_size_for(cls, world: int, options: Any = None) -> int:
        """How many data shards a world of ``world`` processes reads (the batch is split that many ways):
        its layout's (:func:`data_parallel_size`), or every process for a strategy that is no mesh (ps)."""
        layout = cls.layout_for(world, options)
        return data_parallel_size(layout) if layout else world

    @classmethod
    def layout_for(cls, world: int, options: Any = None) -> dict[str, int]:
        """This strategy's layout on ``world`` processes as mesh dimensions (:mod:`.mesh`): ``{"dp_replicate": N}``
        for plain data parallel; ``{}`` for a strategy that is no mesh (one process, a parameter server)."""
        return {"dp_replicate": world} if cls.processes != "one" and world > 1 else {}

    # --- data layout ----------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        return self.data_parallel_size_for(self.proc.world_size, self.options)

    @property
    def data_parallel_rank(self) -> int:
        return self.proc.rank

    @property
    def data_parallel_leader(self) -> bool:
        """Is this the lowest rank of those that read the same data shard (one per shard)?"""
        return True

    # --- what Parallel calls: the strategy with its precision ------------------------------
    def prepare_model(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """``(wrapped, user's module)``: a wrapper the user made that :meth:`adopt` keeps, else the
        precision's model (low-precision weights...) placed and wrapped by :meth:`setup_model`."""
        adopted = self.adopt(model)
        if adopted is not None:
            if self.precision.master_weights or self.precision.float8:
                raise ValueError(f"precision {self.precision.name} converts the model's weights or layers: pass the "
                                 f"plain module to setup, not one already wrapped in {type(adopted).__name__}")
            return adopted, self.unwrap(adopted)
        if self.activation_checkpointing:
            apply_activation_checkpointing(model, self.activation_checkpointing)  # before sharding, as torchtitan
        model = self.precision.setup_model(model)  # the user's module from now on (fp8: a bare Linear is replaced)
        wrapped = self.setup_model(model)
        self.precision.broadcast()  # the model now holds rank 0's weights: so does what the precision keeps
        return wrapped, model

    def prepare_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """:meth:`setup_optimizer`, then the precision's (fp32 masters in place of the parameters)."""
        return self.precision.setup_optimizer(self.setup_optimizer(model, optimizer))

    def mark_forward_method(self, module: nn.Module, name: str) -> None:
        """Make ``module.<name>()`` (a method other than forward, e.g. ``encode``) run as a forward
        does under this strategy (fsdp gathers the root's parameters around it); default: nothing."""

    def model_loaded(self, module: nn.Module) -> None:
        """The user loaded new weights into the set-up ``module``: the precision's masters and
        :meth:`sync_from_model`'s copies follow."""
        self.precision.sync_from_model()
        self.sync_from_model(module)

    def step(self, optimizer: torch.optim.Optimizer, models: list[nn.Module], ends_batch: bool = True) -> bool | Stepped:
        """One optimizer step: the precision's (unscale, clip, step) through :meth:`optimizer_step`.
        The step that ends a global batch clips (``max_grad_norm``) each of the precision's
        :meth:`~paratrain.precision.Precision.clip_targets` of ``models`` with :meth:`clip_grad_norm`;
        another optimizer stepping on the same gradients after it (``ends_batch`` False) does not."""
        if not ends_batch and (self.precision.scales_loss or self.precision.master_weights):
            raise ValueError(f"two optimizers stepping after one backward under precision {self.precision.name}: its "
                             "loss scale or master weights follow one optimizer; use one optimizer with a parameter "
                             "group each, or precision bf16-mixed or 32")
        clip = None
        if ends_batch and self.max_grad_norm is not None:
            max_norm = self.max_grad_norm
            clip = lambda: [self.clip_grad_norm(ps, max_norm) for ps in self.precision.clip_targets(models)]  # noqa: E731
        return self.optimizer_step(optimizer, lambda: self.precision.step(optimizer, clip))

    # --- model ----------------------------------------------------------------------------
    def adopt(self, model: nn.Module) -> nn.Module | None:
        """A model the user already wrapped that this strategy keeps as it is (ddp keeps the
        user's own ``DistributedDataParallel``), or None: :meth:`setup_model` wraps it. A wrapper
        this strategy cannot use is a one-line error."""
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            raise ValueError(f"the model is already wrapped in {type(model).__name__}: pass the plain module, "
                             f"strategy {self.name!r} wraps it itself")
        return None

    def setup_model(self, model: nn.Module) -> nn.Module:
        """Move to the device, convert BatchNorm if asked, and wrap (a model built on the meta device
        by ``init_module`` stays there until its shards are made: :mod:`paratrain.nn.deferred`)."""
        if not any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers())):
            model = model.to(self.device)
        if self.sync_batchnorm:
            model = self.convert_batchnorm(model)
        return self.wrap(model)

    def convert_batchnorm(self, model: nn.Module) -> nn.Module:
        if self.proc.world_size == 1:
            return model  # one process: plain BatchNorm already sees the whole batch
        return convert_sync_batchnorm(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module, without any wrapper this strategy added."""
        return model.module if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) else model

    def setup_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Adapt an optimizer built before :meth:`setup_model` (e.g. rebuild it over sharded parameters)."""
        return optimizer

    def eval_forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """Evaluation forward of the unwrapped model; ``None`` when this rank produces no output."""
        return model(x)

    def training_step(self, model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor],
                      backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch ``(inputs, targets)``; returns the loss.

        Strategies whose schedule runs forward and backward together (pipeline) override this. paratrain's
        own losses (cross-entropy, :func:`~paratrain.models.gpt.token_loss`: ``computes_in_fp32``) run with the
        forward under the precision's autocast, which computes them in fp32 from the low-precision logits
        without an fp32 copy of them (:meth:`~paratrain.Parallel.autocast`); a loss of your own gets fp32 outputs.
        """
        with self.precision.forward_context() if computes_in_fp32(loss_fn) else contextlib.nullcontext():
            loss = self._forward_loss(model, batch, loss_fn)
        backward(loss)  # outside autocast, as PyTorch's AMP recipe runs it
        return loss

    def _forward_loss(self, model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        out = model(batch[0])
        if loss_fn is nn.functional.cross_entropy and not isinstance(out, torch.Tensor):
            # the default loss of a model returning a dict, dataclass or HuggingFace output: its logits
            # (a loss_fn of the user's own gets the output as it is)
            logits = predictions(out)
            if logits is None:
                raise TypeError(f"the model returned a {type(out).__name__} with no logits for cross-entropy: "
                                "return a tensor, or an output with a 'logits' entry, or give a loss_fn")
            out = logits
        return loss_fn(out, batch[1])

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state as plain CPU tensors on every rank (unsharded, all stages)."""
        if self.sharded_state:
            return {k: v.detach().cpu().clone() for k, v in sharded_full_state_dict(model).items()}
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    def hidden_comm_bytes_per_step(self, model: nn.Module) -> int:
        """Bytes this rank communicates per optimizer step outside ``torch.distributed``'s Python
        functions (C++ reducers, RPC), which a counter wrapping those functions cannot see."""
        return 0

    def comm_dimensions(self) -> dict[str, str]:
        """Each process group's name -> the layout dimension its traffic belongs to (``pp``, ``dp_shard``,
        ``tp``...; bench's bytes per dimension). The default group's is the layout's one dimension larger
        than 1; a strategy with a mesh adds its groups (:func:`mesh_dimensions`)."""
        busy = [d for d, n in self.layout.items() if n > 1]
        if len(busy) != 1 or not (dist.is_available() and dist.is_initialized()):
            return {}
        return {"": busy[0], str(getattr(dist.group.WORLD, "group_name", "")): busy[0]}

    def optimizer_step(self, optimizer: torch.optim.Optimizer, local_step: Callable[[], bool | Stepped]) -> bool | Stepped:
        """Apply one optimizer step; ``local_step`` is the precision's (clip, unscale, step).
        True if the weights changed. A parameter server steps remotely instead."""
        return local_step()

    def checkpoint_module(self, wrapped: nn.Module, original: nn.Module) -> nn.Module:
        """The module whose parameters this rank holds and checkpoints, given what
        :meth:`setup_model` returned and the user's module: the user's module (sharded in place
        by fsdp/tensor), or a pipeline's stage."""
        return original

    def held_parts(self, wrapped: nn.Module, original: nn.Module) -> Held:
        """The parts of the user's module this rank holds values of: what a model built under
        ``init_module`` materialises (:mod:`paratrain.nn.deferred`). All of it, sharded or not."""
        return Held((original,))

    def checkpoint_state(self, module: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Model and optimizer state for an unsharded checkpoint (rank 0 writes it)."""
        return module.state_dict(), None if optimizer is None else optimizer.state_dict()

    def load_checkpoint_state(self, module: nn.Module, optimizer: Any, model_state: dict[str, Any],
                              optim_state: dict[str, Any] | None) -> None:
        """Restore what :meth:`checkpoint_state` returned (called on every rank); the precision then
        sees the loaded weights (fp32 masters from them when the checkpoint had none)."""
        module.load_state_dict(model_state)
        if optimizer is not None and optim_state is not None:
            optimizer.load_state_dict(optim_state)
        self.precision.checkpoint_loaded()

    def sync_from_model(self, module: nn.Module) -> None:
        """The user loaded new weights into the set-up model: refresh copies kept elsewhere (ps)."""

    def report(self) -> dict[str, Any]:
        """Strategy-specific numbers for the run's summary (e.g. the parameter server's updates)."""
        return {}

    def close(self, wait_for_peers: bool = True) -> None:
        """Release what the strategy started besides the process group (RPC...)."""

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """Turn gradient synchronisation off for accumulation micro-steps (``no_sync``)."""

    # --- collectives for metrics ----------------------------------------------------------
    @property
    def metrics_group(self) -> Any:
        """The process group over which the ranks hold different evaluation data (``pt.all_gather``,
        ``pt.reduce``): None, every rank."""
        return None

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.proc.backend is not None and self.proc.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.proc.backend is not None and self.proc.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Scale the gradients of ``parameters`` so that their global norm is at most ``max_norm``."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    @staticmethod
    def warn(message: str, main_only: bool = True, rank: int = 0) -> None:
        if not main_only or rank == 0:
            warnings.warn(message, stacklevel=3)
