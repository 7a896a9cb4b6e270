"""Strategies, one small module each, chosen by name."""

from __future__ import annotations

from typing import Any, Literal

from ..env.process import Dist
from ..precision import Precision, build as build_precision
from .base import Strategy
from .ddp import DDPOptions, DDPStrategy
from .devices import DevicesStrategy, DevicesOptions
from .dp import DataParallelStrategy
from .fsdp import FSDPOptions, FSDPStrategy
from .mesh import MeshOptions, MeshStrategy
from .pipeline import PipelineStrategy, PipelineOptions
from .ps import ParameterServerStrategy, PSOptions
from .single import SingleDeviceStrategy
from .tensor import TensorOptions, TensorParallelStrategy

__all__ = ["Strategy", "STRATEGIES", "DDPOptions", "FSDPOptions", "TensorOptions", "PipelineOptions",
           "DevicesOptions", "PSOptions", "MeshOptions", "build", "resolve", "reference", "data_parallel_reference",
           "bench_defaults", "for_mesh", "agrees_with_mesh", "describe_layout", "StrategyName", "AUTO", "auto"]

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDeviceStrategy,
    "dp": DataParallelStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "tensor": TensorParallelStrategy,
    "pipeline": PipelineStrategy,
    "devices": DevicesStrategy,
    "ps": ParameterServerStrategy,
    "mesh": MeshStrategy,
}

# The names above and AUTO as a type, for editors' completion of ``Parallel(strategy=...)`` (a test keeps it equal).
StrategyName = Literal["auto", "single", "dp", "ddp", "fsdp", "tensor", "pipeline", "devices", "ps", "mesh"]

AUTO = "auto"  # the default: the reference strategy in one process, plain data parallel in several (:func:`auto`)


def _declaring(fact: str) -> str:
    """The name of the one registered strategy whose class sets the boolean ``fact``."""
    names = [name for name, cls in STRATEGIES.items() if getattr(cls, fact)]
    if len(names) != 1:
        raise RuntimeError(f"exactly one strategy must declare {fact}; found {names}")
    return names[0]


def reference() -> str:
    """The single-device strategy every other one is checked against (``reference = True``)."""
    return _declaring("reference")


def data_parallel_reference() -> str:
    """The plain data-parallel strategy (``plain_data_parallel = True``): verify's N-process run for
    one-process strategies, and bench's comm-hook, nccl and effective-batch cells."""
    return _declaring("plain_data_parallel")


def auto(world_size: int) -> str:
    """The strategy ``"auto"`` stands for on ``world_size`` processes: the one-process reference
    (``single``) alone, plain data parallel (``ddp``) on several, as Lightning's and Accelerate's
    defaults choose."""
    return data_parallel_reference() if world_size > 1 else reference()


def for_mesh(layout: MeshOptions) -> str:
    """The strategy that runs ``layout``: pipeline where it has ``pp`` (its stages then replicated or
    sharded over the data-parallel dimensions), else the mesh strategy."""
    return PipelineStrategy.name if layout.pp not in (None, 1) else MeshStrategy.name


def agrees_with_mesh(name: str, layout: MeshOptions) -> bool:
    """Whether ``strategy=name`` may be given beside ``mesh=layout``: auto, the mesh strategy, or the one that runs it."""
    return name in (AUTO, MeshStrategy.name, for_mesh(layout))


def describe_layout(name: str, world: str = "N") -> str:
    """``"ddp is mesh dp_replicate=N"``: a strategy's shorthand, for messages."""
    spelled = {"ddp": "dp_replicate=N", "fsdp": "dp_shard=N", "tensor": "dp_shard=N/k,tp=k (tp_size k)",
               "pipeline": "pp=N"}
    return f"{name} is mesh {spelled[name]}" if name in spelled else f"{name} is no mesh layout"


def bench_defaults(quick: bool = False) -> list[str]:
    """Strategies in paratrain bench's default matrix (``--quick``: the fast subset), registry order."""
    tiers = ("quick",) if quick else ("quick", "full")
    return [name for name, cls in STRATEGIES.items() if cls.bench_default in tiers]


def resolve(name: str) -> type[Strategy]:
    """The strategy class called ``name``; a one-line error naming the choices otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy {name!r} is unknown: use one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def build(cfg: Any, dist_info: Dist, precision: Precision | None = None) -> Strategy:
    """The strategy named by ``cfg.strategy`` (a ParallelConfig; ``auto`` for this world), with its options section
    (``cfg.ddp`` for ddp, ``cfg.fsdp`` for fsdp...) when the config has one, and ``precision``
    (default: the config's, built for this process's device)."""
    cfg = cfg.for_world(dist_info.world_size)  # "auto": the strategy it stands for in this world
    cls = resolve(cfg.strategy)
    if precision is None:
        precision = build_precision(cfg.precision, dist_info.device, cfg.loss_scale)
    return cls(dist_info, cfg.sync_batchnorm, cls.options_of(cfg), precision=precision, layout=cfg.layout(dist_info.world_size),
               max_grad_norm=cfg.clip_grad_norm, activation_checkpointing=getattr(cfg, "activation_checkpointing", None))
