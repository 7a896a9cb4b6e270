"""``Tracker``: one place a run's metrics go (files, TensorBoard, Weights & Biases, MLflow, Comet)."""

from __future__ import annotations

import abc
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["Tracker", "NoTracker", "numeric", "flatten"]


class Tracker(abc.ABC):
    """One backend. Paratrain calls it on the main process only, so a backend's run (a wandb or
    MLflow run, an event file) is created lazily, on the first call: an instance made on every
    rank (``Parallel(log_to=[MyTracker()])``) opens nothing on the others.

    Your own backend subclasses it: a ``name`` (what ``pt.tracker(name)`` finds),
    :meth:`log_metrics`, and where it has them :meth:`log_config`, :meth:`log_image`,
    :meth:`log_histogram`, :meth:`log_table`, :meth:`close` and :attr:`experiment` (its own object,
    what ``pt.tracker(name, unwrap=True)`` returns). A kind it does not define is not recorded
    there, with a one-line warning the first time.

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
        return None  # optional: a backend without a config concept records nothing

    @abc.abstractmethod
    def log_metrics(self, metrics: Mapping[str, Any], step: int, kind: str) -> None:
        """Record ``metrics`` at optimizer step ``step``; ``kind`` groups them (``train``, ``eval``).
        Every backend has it: a subclass without it cannot be instantiated."""

    def log_image(self, name: str, image: Any, step: int, kind: str) -> None:
        """Record ``image``, an ``H x W x C`` ``uint8`` NumPy array (C: 1, 3 or 4), as ``<kind>/<name>``."""
        self._cannot("images", "log_image")

    def log_histogram(self, name: str, values: Any, step: int, kind: str) -> None:
        """Record the distribution of ``values``, a flat ``float64`` NumPy array, as ``<kind>/<name>``."""
        self._cannot("histograms", "log_histogram")

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int, kind: str) -> None:
        """Record a table (``rows``: lists of plain values, one per column) as ``<kind>/<name>``."""
        self._cannot("tables", "log_table")

    @property
    def experiment(self) -> Any:
        """The backend's own object (a wandb run, a ``SummaryWriter``, an ``MlflowClient``), started
        if it was not yet; None where there is none (csv)."""
        return None

    def close(self, ok: bool = True) -> None:
        """Flush and finish the run (``ok=False``: the job failed)."""
        return None  # optional: a backend with nothing open has nothing to finish

    def _cannot(self, what: str, method: str) -> None:
        warned = self.__dict__.setdefault("_cannot_warned", set())
        if what not in warned:
            warned.add(what)
            warnings.warn(f"tracker {self.name!r} ({type(self).__name__}) takes no {what}: pt.{method} records them "
                          f"in the other trackers only (define {method} on it)", stacklevel=5)


class NoTracker:
    """What ``pt.tracker(name)`` returns on ranks other than the main process, where no backend is
    opened: any attribute, call or item of it is itself, so ``pt.tracker("wandb", unwrap=True).log(...)``
    does nothing there; it is falsy (``if run := pt.tracker("wandb", unwrap=True):``)."""

    def __getattr__(self, name: str) -> NoTracker:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> NoTracker:
        return self

    def __getitem__(self, key: Any) -> NoTracker:
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __setattr__(self, name: str, value: Any) -> None:
        pass

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __enter__(self) -> NoTracker:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "NoTracker()"


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
