"""``Tracker``: one place a run's metrics go (files, TensorBoard, Weights & Biases, MLflow)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["Tracker", "numeric", "flatten"]


class Tracker:
    """One backend. Paratrain calls it on the main process only, so a backend's run (a wandb or
    MLflow run, an event file) is created lazily, on the first call: an instance made on every
    rank (``Parallel(loggers=[...])``) opens nothing on the others.

    ``log_dir``, ``run_name`` and ``append`` are filled in by :class:`~paratrain.tracking.Trackers`
    when the instance was made without them (``append``: a resumed run continues its files, and
    its wandb or MLflow run, see :meth:`resumed_run`).
    """

    name = "tracker"
    package: str | None = None
    """The pip package it needs (None: nothing beyond paratrain's own dependencies)."""

    def __init__(self, log_dir: str | None = None, run_name: str | None = None) -> None:
        self.log_dir = log_dir
        self.run_name = run_name
        self.append = False
        self.resume_step: int | None = None
        """With ``append``: the step the run resumed from; what was logged after it is logged again."""

    RUNS_FILE = "trackers.json"
    """In the run folder: each backend's run (wandb id, MLflow run id), so that a resumed run
    continues the same one instead of starting another."""

    def resumed_run(self) -> dict[str, Any] | None:
        """What :meth:`remember_run` saved for this backend, when this is a resumed run (``append``)."""
        path = os.path.join(self.log_dir or ".", self.RUNS_FILE)
        if not self.append or not os.path.exists(path):
            return None
        with open(path) as f:
            found = json.load(f).get(self.name)
        return found if isinstance(found, dict) else None

    def remember_run(self, info: dict[str, Any]) -> None:
        """Save ``info`` (the backend's run id...) in the run folder's :data:`RUNS_FILE`."""
        path = os.path.join(self.log_dir or ".", self.RUNS_FILE)
        runs = {}
        if os.path.exists(path):
            with open(path) as f:
                runs = json.load(f)
        runs[self.name] = info
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(runs, f, indent=1)
        os.replace(path + ".tmp", path)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's config and provenance where the backend has such a concept (once, before metrics)."""

    def log_metrics(self, metrics: Mapping[str, Any], step: int, kind: str) -> None:
        """Record ``metrics`` at optimizer step ``step``; ``kind`` groups them (``train``, ``eval``)."""
        raise NotImplementedError

    def close(self, ok: bool = True) -> None:
        """Flush and finish the run (``ok=False``: the job failed)."""


def scalar(value: Any) -> Any:
    """A one-element tensor or array, or a NumPy number, as its Python number; anything else as is."""
    if hasattr(value, "item") and (getattr(value, "numel", None) or getattr(value, "size", None)) is not None:
        size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", 0)
        if size == 1:
            return value.item()
    return value


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The values a scalar backend can plot: ints and floats (tensors, arrays and NumPy numbers of
    one element included), not bools."""
    out = {}
    for key, value in metrics.items():
        value = scalar(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"parallel": {"seed": 0}}`` -> ``{"parallel.seed": 0}``, for backends whose config is flat."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
