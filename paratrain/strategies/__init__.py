"""Strategies, one small module each, chosen by name."""

from __future__ import annotations

from typing import Any

from ..env.process import Dist
from .base import Strategy
from .ddp import DDPOptions, DistributedDataParallel
from .devices import Devices, DevicesOptions
from .dp import DataParallel
from .fsdp import FSDPOptions, FullyShardedDataParallel
from .pipeline import Pipeline, PipelineOptions
from .single import SingleDevice
from .tensor import TensorOptions, TensorParallel

__all__ = ["Strategy", "STRATEGIES", "DDPOptions", "FSDPOptions", "TensorOptions", "PipelineOptions",
           "DevicesOptions", "build", "resolve"]

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDevice,
    "dp": DataParallel,
    "ddp": DistributedDataParallel,
    "fsdp": FullyShardedDataParallel,
    "tensor": TensorParallel,
    "pipeline": Pipeline,
    "devices": Devices,
}


# Strategies with their own training loop (not behind Parallel): rank 0 of ``ps`` serves, it trains nothing.
LOOP_STRATEGIES = ("ps",)


def check_name(name: str) -> None:
    """One-line error unless ``name`` is a strategy (``STRATEGIES`` or ``LOOP_STRATEGIES``)."""
    if name not in STRATEGIES and name not in LOOP_STRATEGIES:
        raise ValueError(f"strategy {name!r} is unknown: use one of {', '.join([*STRATEGIES, *LOOP_STRATEGIES])}")


def resolve(name: str) -> type[Strategy]:
    check_name(name)
    if name in LOOP_STRATEGIES:
        raise ValueError(f"strategy {name!r} runs its own loop (rank 0 is the server): use `paratrain train "
                         f"--strategy {name}` or paratrain.strategies.ps.run_parameter_server, not Parallel")
    return STRATEGIES[name]


def build(cfg: Any, dist_info: Dist) -> Strategy:
    """The strategy named by ``cfg.strategy`` (a ParallelConfig), with its options section
    (``cfg.ddp`` for ddp, ``cfg.fsdp`` for fsdp...) when the config has one."""
    cls = resolve(cfg.strategy)
    return cls(dist_info, cfg.sync_batchnorm, getattr(cfg, cls.name, None))
