"""The defaults of ``Parallel()`` chosen at launch (``paratrain run --strategy/--precision/--set``, a
project's ``paratrain.toml``): read and validated in the launcher (:func:`parallel_defaults`), and
merged under the code's own arguments in each worker (:func:`over_launch_defaults`). The
environment variables that carry them are :mod:`paratrain.env.defaults`'s."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from typing import Any, Mapping

from .. import precision as _precision
from ..env import defaults as launch_defaults
from ..env.detect import detect_process
from .files import apply_overrides, from_dict, load_config
from .parallel import ParallelConfig
from .train import TrainConfig

__all__ = ["parallel_defaults", "over_launch_defaults"]


_NOTICED: set[str] = set()  # notices printed by this process (a loop building Parallel() again says nothing new)


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


def over_launch_defaults(options: Mapping[str, Any]) -> dict[str, Any]:
    """``Parallel``'s keyword ``options`` over the defaults set at launch (the code wins); where the
    two disagree, one line on the main process names both values and where the default came from."""
    table, sources = launch_defaults.read()
    if not table:
        return dict(options)
    try:
        chosen = from_dict(ParallelConfig, table, "parallel")
    except ValueError as e:
        origin = sorted(set(sources.values()) - {launch_defaults.VARIABLE})
        raise ValueError(f"{e} (in the defaults set at launch, {launch_defaults.VARIABLE}"
                         + (f": from {', '.join(origin)})" if origin else ")")) from None
    defaults = {key: ({k: getattr(getattr(chosen, key), k) for k in value} if isinstance(value, Mapping)
                      else getattr(chosen, key)) for key, value in table.items()}
    merged, differ = dict(defaults), []
    for key, value in options.items():
        default = defaults.get(key)
        if isinstance(default, dict):  # a section: the code's keys over the launch's
            whole = dataclasses.is_dataclass(value) and not isinstance(value, type)  # an Options object
            given = dataclasses.asdict(value) if whole else value  # type: ignore[arg-type]
            merged[key] = {**default, **value} if isinstance(value, Mapping) else value
            if isinstance(given, Mapping):
                differ += [(f"{key}.{k}", given[k], v) for k, v in default.items() if k in given and given[k] != v]
            continue
        merged[key] = value
        if key in defaults and not _same(key, value, default):
            differ.append((key, value, default))
    if differ and detect_process().rank == 0:
        line = (f"paratrain: Parallel({', '.join(f'{k}={v!r}' for k, v, _ in differ)}) in the code wins over the "
                f"default{'s' if len(differ) > 1 else ''} set at launch: "
                + ", ".join(f"{k}={d!r} ({sources.get(k, launch_defaults.VARIABLE)})" for k, _, d in differ))
        if line not in _NOTICED:
            _NOTICED.add(line)
            print(line, file=sys.stderr, flush=True)
    return merged


def _same(key: str, given: Any, default: Any) -> bool:
    """Whether the code's ``given`` value of ``key`` is the launch's ``default`` (a precision's alias too)."""
    if key == "precision":
        try:
            return _precision.resolve(given) == default
        except ValueError:
            return False
    return bool(given == default)
