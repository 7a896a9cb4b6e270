"""Typed, self-validating configuration (torchtitan style), loadable from TOML/YAML with overrides.

A config file mirrors the dataclasses: top-level keys of :class:`TrainConfig`, and tables
``[parallel]``, ``[parallel.ddp]``, ``[data]``, ``[optim]``. Any field can be overridden from
the command line with ``--set section.field=value``.

One path builds a config: :meth:`TrainConfig.load` (a file plus dotted overrides, validated once);
one derives another from it: :meth:`TrainConfig.with_overrides`. Code passes the dataclass around,
never the dict it came from.
"""

from __future__ import annotations

from .files import apply_overrides, from_dict, load_config, parse_set, to_toml
from .launch import parallel_defaults
from .parallel import ACCELERATORS, BACKENDS, ParallelConfig
from .train import SCHEDULES, DataConfig, OptimConfig, TrainConfig

__all__ = ["ParallelConfig", "DataConfig", "OptimConfig", "TrainConfig", "load_config", "apply_overrides", "from_dict",
           "parse_set", "parallel_defaults", "to_toml", "BACKENDS", "ACCELERATORS", "SCHEDULES"]
