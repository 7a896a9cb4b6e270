"""Where a run's metrics go: ``csv`` (CSV + JSONL files), ``tensorboard``, ``wandb``, ``mlflow``.

One small file per backend behind :class:`~paratrain.tracking.base.Tracker`; :class:`Trackers`
sends each record to all of them, on the main process only. ``Parallel(log_to=[...])``,
``pt.log(...)`` and ``paratrain train --log-to`` are built on it.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Callable

from .base import Tracker
from .files import CSVTracker
from .mlflow import MLflowTracker
from .runs import latest_run, link_latest, new_run_dir
from .tensorboard import TensorBoardTracker
from .wandb import WandbTracker

__all__ = ["Tracker", "Trackers", "TRACKERS", "parse_log_to", "CSVTracker", "TensorBoardTracker", "WandbTracker",
           "MLflowTracker", "new_run_dir", "link_latest", "latest_run"]

TRACKERS: dict[str, type[Tracker]] = {
    "csv": CSVTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MLflowTracker,
}
_EXTRA = {"tensorboard": "tensorboard", "wandb": "trackers", "mlflow": "trackers"}


def parse_log_to(log_to: str | Iterable[str] | None) -> list[str]:
    """``"csv,wandb"`` or ``["csv", "wandb"]`` -> ``["csv", "wandb"]``, each known and installed, or a
    one-line ``ValueError`` naming the value and what to install."""
    if log_to is None:
        return []
    if not isinstance(log_to, (str, list, tuple, set, frozenset)):
        raise ValueError(f"log_to {log_to!r} must be a tracker name or a list of them, e.g. \"csv,tensorboard\"")
    items = log_to.split(",") if isinstance(log_to, str) else list(log_to)
    names: list[str] = []
    for item in items:
        name = str(item).strip().lower()
        if not name or name in names:
            continue
        if name not in TRACKERS:
            raise ValueError(f"log_to {item!r} is unknown: use {', '.join(TRACKERS)} (comma-separated)")
        package = TRACKERS[name].package
        if package is not None and importlib.util.find_spec(package) is None:
            raise ValueError(f"log_to {name!r} needs the {package} package: pip install {package} "
                             f"(or pip install 'paratrain[{_EXTRA[name]}]'), or drop {name!r} from log_to")
        names.append(name)
    return names


class Trackers:
    """The backends named in ``log_to`` plus the ``loggers`` given as instances, opened on first use.

    ``enabled=False`` (ranks other than the main process) makes every call a no-op and creates no
    backend. ``log_dir=None`` with backends to open makes a fresh run folder, ``runs/<start time>``.
    ``config`` (a mapping, or a function returning one, called once) is each backend's run config.
    """

    def __init__(self, log_to: str | Iterable[str] | None = None, log_dir: str | None = None,
                 loggers: Iterable[Tracker] = (), *, enabled: bool = True, append: bool = False,
                 config: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.names = parse_log_to(log_to)
        self.loggers = list(loggers)
        for logger in self.loggers:
            if not isinstance(logger, Tracker):
                raise ValueError(f"loggers: {logger!r} is not a paratrain.tracking.Tracker")
        self.log_dir = log_dir
        self.enabled = enabled and bool(self.names or self.loggers)
        self.append = append
        self.resume_step: int | None = None
        self.config = config
        self._open: list[Tracker] | None = None

    def resume_at(self, step: int) -> None:
        """The run continues from ``step`` (a checkpoint was loaded): the backends continue their
        files and runs, and records logged after ``step`` by the interrupted run are dropped."""
        self.append, self.resume_step = True, step
        for tracker in self._open or []:
            tracker.append, tracker.resume_step = True, step

    def open(self) -> list[Tracker]:
        """The backends, made (with the run's config given to them) on the first call."""
        if self._open is None:
            if self.log_dir is None:
                self.log_dir = new_run_dir()
            name = _run_name(self.log_dir)
            made = [TRACKERS[n](self.log_dir, name) for n in self.names] + self.loggers
            for tracker in made:
                tracker.log_dir = tracker.log_dir or self.log_dir
                tracker.run_name = tracker.run_name or name
                tracker.append, tracker.resume_step = self.append, self.resume_step
            config = self.config() if callable(self.config) else self.config
            if config:
                for tracker in made:
                    tracker.log_config(config)
            self._open = made
            atexit.register(self._close_at_exit)  # a loop that never calls pt.close() still finishes its runs
        return self._open

    def log(self, metrics: Mapping[str, Any], step: int, kind: str = "train") -> None:
        if self.enabled:
            for tracker in self.open():
                tracker.log_metrics(metrics, step, kind)

    def close(self, ok: bool = True) -> None:
        """Finish every opened backend (the wandb/MLflow run, the event file); safe to call twice."""
        for tracker in self._open or []:
            tracker.close(ok)

    def _close_at_exit(self) -> None:
        from ..env.failures import uncaught_seen

        # failed when the process ends with an exception (the interpreter keeps the uncaught one)
        try:
            self.close(ok=not (uncaught_seen() or getattr(sys, "last_value", None) is not None))
        except Exception:  # a backend already gone (its folder deleted, its server down): nothing to finish
            pass


def _run_name(log_dir: str) -> str:
    return os.path.basename(os.path.abspath(log_dir))
