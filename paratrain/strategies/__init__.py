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
from .ps import ParameterServer, PSOptions
from .single import SingleDevice
from .tensor import TensorOptions, TensorParallel

__all__ = ["Strategy", "STRATEGIES", "DDPOptions", "FSDPOptions", "TensorOptions", "PipelineOptions",
           "DevicesOptions", "PSOptions", "build", "resolve"]

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDevice,
    "dp": DataParallel,
    "ddp": DistributedDataParallel,
    "fsdp": FullyShardedDataParallel,
    "tensor": TensorParallel,
    "pipeline": Pipeline,
    "devices": Devices,
    "ps": ParameterServer,
}


def resolve(name: str) -> type[Strategy]:
    """The strategy class called ``name``; a one-line error naming the choices otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy {name!r} is unknown: use one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def build(cfg: Any, dist_info: Dist) -> Strategy:
    """The strategy named by ``cfg.strategy`` (a ParallelConfig), with its options section
    (``cfg.ddp`` for ddp, ``cfg.fsdp`` for fsdp...) when the config has one."""
    cls = resolve(cfg.strategy)
    return cls(dist_info, cfg.sync_batchnorm, getattr(cfg, cls.name, None))
