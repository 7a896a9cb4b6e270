"""The defaults of ``Parallel()`` chosen at launch, as the workers receive them: environment variables.

``paratrain run --strategy ddp --precision bf16-mixed --set parallel.seed=3 train.py`` (and a
project's ``paratrain.toml``) sets them in the launcher; torchrun hands the launcher's environment
to every worker, where :meth:`paratrain.config.ParallelConfig.of` reads them under the arguments
the code gives ``Parallel(...)`` (the code wins). Any launcher can set them by hand:

* ``PARATRAIN_PARALLEL``: the ``[parallel]`` table as JSON, ``{"strategy": "ddp", "ddp": {"comm_hook": "fp16"}}``;
* ``PARATRAIN_PARALLEL_FROM`` (optional, informative): where each dotted key came from,
  ``{"strategy": "paratrain run --strategy"}``; a key not named there came from ``PARATRAIN_PARALLEL``.

This module only carries the table; :mod:`paratrain.config` validates it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

__all__ = ["VARIABLE", "SOURCES", "PROJECT_FILE", "read", "encode", "dotted"]

VARIABLE = "PARATRAIN_PARALLEL"
SOURCES = "PARATRAIN_PARALLEL_FROM"
PROJECT_FILE = "paratrain.toml"  # a project's defaults, read by `paratrain run` in its working directory


def read(environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``[parallel]`` table set at launch (empty when none) and where each dotted key came from;
    a variable that is not a JSON table is a one-line ``ValueError`` naming it."""
    environ = os.environ if environ is None else environ
    raw = environ.get(VARIABLE, "").strip()
    if not raw:
        return {}, {}
    try:
        table = json.loads(raw)
    except json.JSONDecodeError:
        table = None
    if not isinstance(table, dict):
        raise ValueError(f"{VARIABLE}={raw!r} is not a JSON table of Parallel's defaults: "
                         f"""e.g. {VARIABLE}='{{"strategy": "ddp", "precision": "bf16-mixed"}}'""")
    try:
        sources = json.loads(environ.get(SOURCES) or "{}")
    except json.JSONDecodeError:
        sources = {}
    sources = sources if isinstance(sources, dict) else {}
    return table, {key: str(sources.get(key, VARIABLE)) for key in dotted(table)}


def encode(table: Mapping[str, Any], sources: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that hand ``table`` (and where its keys came from) to the workers."""
    return {VARIABLE: json.dumps(table, default=str), SOURCES: json.dumps(dict(sources))}


def dotted(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"ddp": {"comm_hook": "fp16"}}`` as ``{"ddp.comm_hook": "fp16"}``."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping) and value:
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
