"""Where a run's metrics go: ``csv`` (CSV + JSONL files), ``tensorboard``, ``wandb``, ``mlflow``, ``comet``.

One small file per backend behind :class:`~paratrain.tracking.base.Tracker`; :class:`Trackers`
sends each record to all of them, on the main process only. ``Parallel(log_to=[...])``,
``pt.log(...)``, ``pt.log_image``/``log_histogram``/``log_table``, ``pt.tracker(name)`` and
``paratrain train --log-to`` are built on it.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Callable

from ..env.disk import writing
from . import media
from .base import NoTracker, Tracker
from .comet import CometTracker
from .face import TrackedRun
from .files import CSVTracker
from .mlflow import MLflowTracker
from .runs import latest_run, link_latest, new_run_dir
from .tensorboard import TensorBoardTracker
from .wandb import WandbTracker

__all__ = ["Tracker", "NoTracker", "Trackers", "TrackedRun", "TRACKERS", "parse_log_to", "CSVTracker", "TensorBoardTracker",
           "WandbTracker", "MLflowTracker", "CometTracker", "new_run_dir", "link_latest", "latest_run"]

TRACKERS: dict[str, type[Tracker]] = {
    "csv": CSVTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MLflowTracker,
    "comet": CometTracker,
}
_EXTRA = {"tensorboard": "tensorboard", "wandb": "trackers", "mlflow": "trackers"}
_PIP = {"comet_ml": "comet-ml"}  # pip names that differ from the import name


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
            extra = f" (or pip install 'paratrain[{_EXTRA[name]}]')" if name in _EXTRA else ""
            raise ValueError(f"log_to {name!r} needs the {package} package: pip install {_PIP.get(package, package)}"
                             f"{extra}, or drop {name!r} from log_to")
        names.append(name)
    return names


class Trackers:
    """The backends named in ``log_to`` plus those given as instances (in ``log_to`` or
    ``loggers``), opened on first use.

    ``enabled=False`` (ranks other than the main process) makes every call a no-op and creates no
    backend. ``log_dir=None`` with backends to open makes a fresh run folder, ``runs/<start time>``.
    ``config`` (a mapping, or a function returning one, called once) is each backend's run config.
    """

    def __init__(self, log_to: str | Iterable[str | Tracker] | None = None, log_dir: str | None = None,
                 loggers: Iterable[Tracker] = (), *, enabled: bool = True, append: bool = False,
                 config: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None) -> None:
        instances: list[Tracker] = []
        if isinstance(log_to, (list, tuple, set, frozenset)) and any(isinstance(t, Tracker) for t in log_to):
            instances = [t for t in log_to if isinstance(t, Tracker)]
            log_to = [t for t in log_to if not isinstance(t, Tracker)]
        self.names = parse_log_to(log_to)  # type: ignore[arg-type]  # the instances are taken out above
        self.loggers = instances + list(loggers)
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
            with self._writing():
                self._open = self._make()
            atexit.register(self._close_at_exit)  # a loop that never calls pt.close() still finishes its runs
        return self._open

    def _writing(self) -> Any:
        """Around what writes the backends' files: a full disk, read-only filesystem or exceeded
        quota there is one line (:class:`~paratrain.env.disk.StorageError`)."""
        return writing(self.log_dir or "runs", flag="log_dir")

    def _make(self) -> list[Tracker]:
        """The backends, their run config given (the run folder made first when there is none)."""
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
        return made

    def log(self, metrics: Mapping[str, Any], step: int, kind: str = "train") -> None:
        if self.enabled:
            with self._writing():
                for tracker in self.open():
                    tracker.log_metrics(metrics, step, kind)

    def log_image(self, name: str, image: Any, step: int, kind: str = "train") -> None:
        """``image`` (a tensor ``C x H x W`` or ``H x W``, an array ``H x W x C``, a PIL image) to every
        backend, as an ``H x W x C`` ``uint8`` array; checked on every rank, converted on the main one."""
        media.check_image(image)
        if self.enabled:
            array = media.image_array(image)
            with self._writing():
                for tracker in self.open():
                    tracker.log_image(name, array, step, kind)

    def log_histogram(self, name: str, values: Any, step: int, kind: str = "train") -> None:
        """The distribution of ``values`` (a tensor, an array, numbers; non-finite ones left out) to every backend."""
        if self.enabled:
            array = media.histogram_values(values)
            with self._writing():
                for tracker in self.open():
                    tracker.log_histogram(name, array, step, kind)

    def log_table(self, name: str, columns: Any = None, data: Any = None, step: int = 0, kind: str = "train",
                  dataframe: Any = None) -> None:
        """A table to every backend: ``columns`` and ``data`` (rows, or a mapping of columns), or a
        pandas ``dataframe``; checked on every rank."""
        names, rows = media.table_of(columns, data, dataframe)
        if self.enabled:
            with self._writing():
                for tracker in self.open():
                    tracker.log_table(name, names, rows, step, kind)

    def get(self, name: str, unwrap: bool = False) -> Any:
        """The backend ``name`` (its ``name`` attribute), opened; ``unwrap``:
        its own object (:attr:`~paratrain.tracking.Tracker.experiment`). A :class:`NoTracker` where
        ``enabled`` is False; a one-line ``ValueError`` on every rank when there is no such backend."""
        known = self.names + [t.name for t in self.loggers if t.name not in self.names]
        if name not in known:
            have = ", ".join(known) if known else "none (log_to is empty)"
            raise ValueError(f"tracker {name!r} is not one this run logs to: {have}")
        if not self.enabled:
            return NoTracker()
        tracker = next(t for t in self.open() if t.name == name)
        return tracker.experiment if unwrap else tracker

    def close(self, ok: bool = True) -> None:
        """Finish every opened backend (the wandb/MLflow run, the event file); safe to call twice."""
        with self._writing():
            for tracker in self._open or []:
                tracker.close(ok)

    def _close_at_exit(self) -> None:
        from ..env.uncaught import uncaught_seen

        # failed when the process ends with an exception (the interpreter keeps the uncaught one)
        try:
            self.close(ok=not (uncaught_seen() or getattr(sys, "last_value", None) is not None))
        except Exception:  # a backend already gone (its folder deleted, its server down): nothing to finish
            pass


def _run_name(log_dir: str) -> str:
    return os.path.basename(os.path.abspath(log_dir))
