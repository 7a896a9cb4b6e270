"""Strategies, one small module each, chosen by name."""

from __future__ import annotations

from typing import Any

from ..env.process import Dist
from .base import Strategy
from .ddp import DDPOptions, DDPStrategy
from .devices import DevicesStrategy, DevicesOptions
from .dp import DataParallelStrategy
from .fsdp import FSDPOptions, FSDPStrategy
from .pipeline import PipelineStrategy, PipelineOptions
from .ps import ParameterServerStrategy, PSOptions
from .single import SingleDeviceStrategy
from .tensor import TensorOptions, TensorParallelStrategy

__all__ = ["Strategy", "STRATEGIES", "DDPOptions", "FSDPOptions", "TensorOptions", "PipelineOptions",
           "DevicesOptions", "PSOptions", "build", "resolve"]

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDeviceStrategy,
    "dp": DataParallelStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "tensor": TensorParallelStrategy,
    "pipeline": PipelineStrategy,
    "devices": DevicesStrategy,
    "ps": ParameterServerStrategy,
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
