"""The defaults of ``Parallel()`` chosen at launch (``paratrain run --strategy/--precision/--set``, a
project's ``paratrain.toml``): read and validated in the launcher (:func:`parallel_defaults`), and
merged under the code's own arguments in each worker (:func:`over_launch_defaults`, which builds a
``ParallelConfig`` and so lives in :mod:`paratrain.config.parallel`; this module only re-exports it).
The environment variables that carry them are :mod:`paratrain.env.defaults`'s."""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping

from ..env import defaults as launch_defaults
from .files import apply_overrides, from_dict, load_config
from .parallel import over_launch_defaults  # re-exported: its home is ParallelConfig's module
from .train import TrainConfig

__all__ = ["parallel_defaults", "over_launch_defaults"]


def parallel_defaults(path: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None,
                      cwd: str | os.PathLike = ".", labels: Mapping[str, str] | None = None
                      ) -> tuple[dict[str, Any], dict[str, str]]:
    """The defaults of ``Parallel()`` that ``paratrain run`` hands to its workers: the ``[parallel]``
    table of the config file ``path`` (None: ``paratrain.toml`` in ``cwd``, if there is one) with the
    dotted ``overrides`` (``{"parallel.strategy": "ddp"}``: the command line's) over it, and where
    each dotted key came from (``labels[key]`` for an override, else "the command line"). The file
    and the overrides are validated as ``paratrain train --config`` validates them: a bad name or
    value is its one-line ``ValueError``."""
    label = "--config " + os.fspath(path) if path is not None else ""
    if path is None and os.path.isfile(project := os.path.join(cwd, launch_defaults.PROJECT_FILE)):
        path, label = project, os.path.join(os.path.abspath(cwd), launch_defaults.PROJECT_FILE)
    data = load_config(path)
    for key in overrides or {}:
        if not key.startswith("parallel."):
            raise ValueError(f"--set {key}: paratrain run sets the defaults of Parallel() only: use "
                             "--set parallel.<key>=<value>, e.g. --set parallel.seed=3")
    from_dict(TrainConfig, apply_overrides(copy.deepcopy(data), dict(overrides or {})))  # the one validation
    table = dict(data.get("parallel") or {})
    sources = dict.fromkeys(launch_defaults.dotted(table), label)
    for key, value in (overrides or {}).items():
        apply_overrides(table, {key.removeprefix("parallel."): value})
        sources[key.removeprefix("parallel.")] = (labels or {}).get(key, "the command line")
    return table, sources
