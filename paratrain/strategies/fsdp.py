"""``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) — every rank keeps 1/N of the model.

Each block (see :class:`FSDPOptions` for what a block is) and then the root are sharded. Forward
all-gathers a block's parameters just before it runs; backward reduce-scatters its gradients, so
each rank ends with the gradient of its own shard and the optimizer steps 1/N of the model.
``reshard_after_forward=True`` frees the gathered parameters after forward (ZeRO-3);
``False`` keeps them until backward (ZeRO-2-like: more memory, one all-gather fewer per step).

FSDP2 replaces parameters by sharded ``DTensor`` parameters, so an optimizer built before
:meth:`Parallel.setup` is pointed at them in place (the same optimizer object, so a scheduler
built on it still acts on it). The helpers here (sharding, that re-pointing, DTensor-aware clipping, parameter bytes) are shared with ``tensor``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from ..env.process import Dist
from ..precision import Precision
from .base import Strategy, mesh_dimensions

__all__ = [
    "FSDPOptions", "FSDPStrategy", "DTensorStrategy", "shard_model", "shard_root", "mixed_precision_policy",
    "parameter_bytes", "ParameterSwap", "clip_grad_norm_",
]


@dataclass(kw_only=True)
class FSDPOptions:
    """FSDP2 settings."""

    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3). False keeps them for backward (ZeRO-2-like)."""
    wrap_classes: list[str] = field(default_factory=list)
    """Class names of the blocks sharded as one unit (e.g. ["Block"]). Empty: a HuggingFace model's
    ``_no_split_modules``, else the elements of the model's stacks of blocks (see min_params)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, their gradients and the optimizer state in host memory (FSDP2's
    ``CPUOffloadPolicy``): the device holds only what is gathered for compute. The optimizer steps
    on the CPU."""
    min_params: int = 0
    """With no wrap_classes: a submodule holding at least this many not-yet-sharded parameters is
    a block. 0: every direct child of the model that has parameters is a block."""

    def __post_init__(self) -> None:
        if isinstance(self.wrap_classes, str):  # from the command line: "Block,Attention"
            self.wrap_classes = [c.strip() for c in self.wrap_classes.split(",") if c.strip()]
        if not all(isinstance(c, str) and c for c in self.wrap_classes):
            raise ValueError(f"fsdp wrap_classes {self.wrap_classes!r} must be a list of class names")
        if self.min_params < 0:
            raise ValueError(f"fsdp min_params {self.min_params} must be >= 0")


def mixed_precision_policy(precision: Precision | None) -> Any:
    """FSDP2's parameter/reduction dtypes: the precision's ``param_dtype`` and ``reduce_dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision is None or precision.param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _repeated(module: nn.Module) -> list[nn.Module] | None:
    """The blocks a container holds: a ModuleList's elements, or a Sequential's children when two
    or more of them have parameters and all of those are of one class (a stack of blocks); None
    otherwise (a ModuleDict is looked through, its values are not a stack)."""
    if isinstance(module, nn.ModuleList):
        return list(module)
    if type(module) is nn.Sequential:
        kids = [m for m in module.children() if any(True for _ in m.parameters())]
        if len(kids) >= 2 and len({type(m) for m in kids}) == 1:
            return kids
    return None


def _stacked_blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of every stack of blocks in ``model`` (outermost stacks only), e.g. nanoGPT's
    ``transformer.h[i]``, BERT's ``encoder.layer[i]``, a ResNet's residual blocks."""
    found: list[nn.Module] = []

    def take(stack: list[nn.Module]) -> None:
        for m in stack:
            if isinstance(m, _CONTAINERS):  # a stack of stacks: its elements' elements
                take(_repeated(m) or list(m.children()))
            elif any(True for _ in m.parameters()):
                found.append(m)

    def visit(module: nn.Module) -> None:
        for child in module.children():
            stack = _repeated(child)
            if stack is not None:
                take(stack)
            else:
                visit(child)

    visit(model)
    return found


def _tie_safe(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """``blocks`` without those that hold only some of a tied parameter's users (GPT-2's ``lm_head``
    and ``wte``): a tied parameter lands in one FSDP group, the root's or a block's that holds all
    of its users (FSDP2 refuses a parameter managed by two groups)."""
    owners: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(m)
    tied = {pid: ms for pid, ms in owners.items() if len(ms) > 1}
    if not tied:
        return blocks
    keep = []
    for block in blocks:
        inside = {id(m) for m in block.modules()}
        split = any(any(id(m) in inside for m in ms) and not all(id(m) in inside for m in ms) for ms in tied.values())
        if not split:
            keep.append(block)
    return keep


def _blocks(model: nn.Module, wrap_classes: list[str], min_params: int) -> list[nn.Module]:
    """The submodules sharded as units, innermost first (fully_shard must go bottom-up).

    ``wrap_classes`` (or else a HuggingFace model's ``_no_split_modules``) name the block classes.
    Otherwise, with ``min_params`` 0, the blocks are the elements of the model's stacks of blocks
    (ModuleList, a Sequential of one block class), anywhere in the tree, never the container
    itself; a model with no such stack shards each direct child that has parameters. Blocks that
    would split a tied parameter's users are left to the root's group."""
    wrap_classes = wrap_classes or (list(getattr(model, "_no_split_modules", None) or []) if not min_params else [])
    if wrap_classes:
        named = [m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in wrap_classes]
        return _tie_safe(model, named)
    if min_params == 0:
        stacked = _stacked_blocks(model)
        if stacked:
            return _tie_safe(model, stacked)
        return _tie_safe(model, [m for m in model.children()
                                 if any(True for _ in m.parameters()) and not isinstance(m, _CONTAINERS)])
    blocks: list[nn.Module] = []
    covered: set[int] = set()  # parameters already inside a chosen block

    def visit(module: nn.Module) -> None:  # post-order: children decide first
        for child in module.children():
            visit(child)
        free = sum(p.numel() for p in module.parameters() if id(p) not in covered)
        if module is not model and free >= min_params and not isinstance(module, _CONTAINERS):
            blocks.append(module)
            covered.update(id(p) for p in module.parameters())

    visit(model)
    return _tie_safe(model, blocks)


def shard_model(model: nn.Module, mesh: Any, options: FSDPOptions, precision: Precision | None = None,
                blocks: list[nn.Module] | None = None, ignored: set[nn.Parameter] | None = None) -> nn.Module:
    """``fully_shard`` each block of ``model`` over ``mesh`` (``blocks``, else those :func:`_blocks`
    finds), then the root, but for the parameters in ``ignored`` (kept whole); returns ``model``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    missing = sorted(set(options.wrap_classes) - {type(m).__name__ for m in model.modules()})
    if missing:
        Strategy.warn(f"fsdp wrap_classes {missing} match no module of the model: those blocks are not sharded")
    policy = mixed_precision_policy(precision)
    if options.cpu_offload and getattr(mesh, "device_type", "cpu") == "cpu":
        Strategy.warn("fsdp cpu_offload: the model trains on the CPU, so its states are in host memory already: "
                      "nothing to offload")
    kwargs = _unit_kwargs(mesh, options, ignored)
    done: set[int] = set()
    if policy.param_dtype is not None:
        # BatchNorm stays fp32, as under autocast: its fp32 running statistics cannot meet
        # low-precision weights and inputs (batch_norm refuses the mix).
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m is not model and m.affine:
                fully_shard(m, mp_policy=fp32, **kwargs)
                done.add(id(m))
    for block in blocks if blocks is not None else _blocks(model, options.wrap_classes, options.min_params):
        if id(block) not in done:
            fully_shard(block, mp_policy=policy, **kwargs)
    fully_shard(model, mp_policy=policy, **kwargs)
    return model


def shard_root(module: nn.Module, mesh: Any, options: FSDPOptions, precision: Precision | None = None,
               ignored: set[nn.Parameter] | None = None) -> nn.Module:
    """``fully_shard`` ``module`` as the FSDP2 root over what :func:`shard_model` sharded inside it (a wrapper that
    holds no parameters of its own), with the same mesh, precision and settings; returns ``module``."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mp_policy=mixed_precision_policy(precision), **_unit_kwargs(mesh, options, ignored))
    return module


def _unit_kwargs(mesh: Any, options: FSDPOptions, ignored: set[nn.Parameter] | None) -> dict[str, Any]:
    """What every ``fully_shard`` call of one model shares: the mesh, resharding, offload and the parameters it
    leaves whole."""
    kwargs: dict[str, Any] = dict(mesh=mesh, reshard_after_forward=options.reshard_after_forward)
    if ignored:
        kwargs["ignored_params"] = ignored
    if options.cpu_offload and getattr(mesh, "device_type", "cpu") != "cpu":
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def parameter_bytes(model: nn.Module) -> dict[str, Any]:
    """Parameter bytes this rank holds (``local``: its shards) and of the whole model (``full``)."""
    from torch.distributed.tensor import DTensor

    local = full = 0
    for p in model.parameters():
        size = p.element_size()
        full += p.numel() * size  # a DTensor's numel is the global one
        local += (p.to_local().numel() if isinstance(p, DTensor) else p.numel()) * size
    return {"local": local, "full": full, "fraction": local / full if full else 1.0}


def format_bytes(n: float) -> str:
    """``136 B``, ``12.5 KiB``, ``3.2 MiB``, ``1.50 GiB``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.2f} GiB"


class ParameterSwap:
    """Remembers which parameters a sharding step replaced, to rebuild an optimizer over the new ones."""

    def __init__(self) -> None:
        self._new: dict[int, tuple[weakref.ref, nn.Parameter]] = {}

    def before(self, model: nn.Module) -> dict[str, nn.Parameter]:
        return dict(model.named_parameters())

    def after(self, model: nn.Module, old: dict[str, nn.Parameter]) -> None:
        # weak references: the old full-size parameters must not stay alive because of us
        for name, p in model.named_parameters():
            if name in old and old[name] is not p:
                self._new[id(old[name])] = (weakref.ref(old[name]), p)

    def lookup(self, p: torch.Tensor) -> torch.Tensor:
        """The parameter that replaced ``p`` (``p`` itself if none did)."""
        entry = self._new.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else p

    def rebuild(self, optimizer: torch.optim.Optimizer, strategy: str) -> torch.optim.Optimizer:
        """The same optimizer object, its param groups now over the new parameters (by position).

        In place, so that whatever holds the optimizer (a learning-rate scheduler built before
        ``setup`` and not passed to it, the user's own reference) keeps acting on the one that
        steps; each ``params`` list is refilled rather than replaced (LBFGS keeps a reference to it).
        """
        new = [[self.lookup(p) for p in g["params"]] for g in optimizer.param_groups]
        if all(n is o for ps, g in zip(new, optimizer.param_groups) for n, o in zip(ps, g["params"])):
            return optimizer  # built after setup: already over the sharded parameters
        if optimizer.state:
            raise ValueError(
                f"{strategy}: the optimizer has already stepped; create it before pt.setup() or after, "
                "but do not step it before: its state cannot follow the parameters into their shards"
            )
        for ps, g in zip(new, optimizer.param_groups):
            g["params"][:] = ps
        return optimizer


def _by_mesh(grads: Iterable[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    return by_mesh


@torch.no_grad()
def total_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of ``grads``, DTensors that may live on several meshes among them: each mesh's
    norm is computed locally and reduced once (``full_tensor``); plain gradients are replicated,
    so their local norm is already the global one."""
    from torch.distributed.tensor import DTensor

    norms = []
    for group in _by_mesh(grads).values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


@torch.no_grad()
def scale_grads_(grads: Iterable[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` (their norm ``total``) to a norm of at most ``max_norm``, as ``clip_grad_norm_`` does: each
    DTensor's local part in place (linear, so right for any placement), without DTensor's sharding dispatch."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for mesh, group in _by_mesh(grads).items():  # mesh None: plain tensors
        local = group if mesh is None else [g.to_local() for g in group]  # type: ignore[attr-defined]  # DTensors
        torch._foreach_mul_(local, coef.to(local[0].device))


@torch.no_grad()
def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for DTensor gradients that may live on several meshes."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = total_norm(grads, norm_type)
    scale_grads_(grads, total, max_norm)
    return total


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2's ``no_sync``: off, gradients accumulate unsharded locally; the last micro-step
    reduce-scatters them."""
    setter = getattr(model, "set_requires_gradient_sync", None)  # FSDP2's FSDPModule
    if setter is not None:
        setter(enabled)


class DTensorStrategy(Strategy):
    """What ``fsdp`` and ``tensor`` share: both turn parameters into ``DTensor`` parameters in
    place, so the optimizer is pointed at them (:class:`ParameterSwap`), ``no_sync`` is FSDP2's
    ``set_requires_gradient_sync``, clipping is DTensor-aware and checkpoints are sharded (DCP)."""

    master_weights_hint = "bf16-mixed (FSDP2 already keeps fp32 sharded master weights and computes in low precision)"
    collective_forward = True
    sharded_state = True

    def __init__(self, dist_info: Dist, sync_batchnorm: bool = False, options: Any = None, **common: Any) -> None:
        super().__init__(dist_info, sync_batchnorm, options, **common)
        self.swap = ParameterSwap()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard and parallelize_module work in place: the module is the user's own

    def setup_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.swap.rebuild(optimizer, self.name)

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        set_gradient_sync(model, enabled)

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(parameters, max_norm)


class FSDPStrategy(DTensorStrategy):
    name = "fsdp"
    whole_layers = True
    bench_default = "quick"
    options_class = FSDPOptions

    @classmethod
    def layout_for(cls, world: int, options: Any = None) -> dict[str, int]:
        return {"dp_shard": world}

    def __init__(self, dist_info: Dist, sync_batchnorm: bool = False, options: Any = None, **common: Any) -> None:
        super().__init__(dist_info, sync_batchnorm, options or FSDPOptions(), **common)
        self._mesh: Any = None

    def comm_dimensions(self) -> dict[str, str]:
        return {**super().comm_dimensions(), **mesh_dimensions(self._mesh, {"dp": "dp_shard"})}

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.proc.backend is None:
            return model  # a world of one: nothing to shard
        from torch.distributed.device_mesh import init_device_mesh

        mesh = self._mesh = init_device_mesh(self.device.type, (self.proc.world_size,), mesh_dim_names=("dp",))
        old = self.swap.before(model)
        shard_model(model, mesh, self.options, self.precision)
        self.swap.after(model, old)
        self._report(model)
        return model

    def mark_forward_method(self, module: nn.Module, name: str) -> None:
        if self.proc.backend is None:
            return
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

        if isinstance(module, FSDPModule):
            register_fsdp_forward_method(module, name)

    def _report(self, model: nn.Module) -> None:
        b = self.parameter_bytes(model)
        if self.proc.is_main_process:
            print(f"paratrain {self.name}: {format_bytes(b['local'])} of {format_bytes(b['full'])} of parameters "
                  f"per rank ({b['fraction']:.0%}) over {self.proc.world_size} processes")

    @staticmethod
    def parameter_bytes(model: nn.Module) -> dict[str, Any]:
        """This rank's parameter bytes (``local``) against the whole model's (``full``)."""
        return parameter_bytes(model)
