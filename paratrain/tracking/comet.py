"""``comet``: a Comet experiment; without an API key (``COMET_API_KEY``, ``comet login``) an offline
one, archived in ``<log_dir>/comet/<key>.zip`` (``comet upload`` sends it). A resumed paratrain run
continues the same experiment (its key is kept in the run folder)."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Mapping
from typing import Any

from .base import Tracker, flatten, numeric
from .media import media_file, png_bytes

__all__ = ["CometTracker"]

FOLDER = "comet"
"""Where an offline experiment's archive goes, in the log folder."""


class CometTracker(Tracker):
    """Metrics as ``<kind>/<name>`` at the optimizer step, the config and provenance as parameters
    (flattened: ``parallel.seed``), images (as PNG), histograms (``log_histogram_3d``) and tables
    (``<kind>/<name>/step-XXXXXXXX.csv`` assets), in project ``project``.

    ``online``: None (default) follows ``COMET_START_ONLINE`` when set, else is online exactly when an
    API key is configured. Further keywords are ``comet_ml.ExperimentConfig`` fields (``tags``,
    ``log_code``, ``auto_output_logging``...); paratrain turns off Comet's own parameter and metric
    logging (``pt.log`` records those) and its summary print. :attr:`experiment` is the Comet
    experiment."""

    name = "comet"
    package = "comet_ml"

    def __init__(self, log_dir: str | None = None, run_name: str | None = None, project: str = "paratrain",
                 workspace: str | None = None, online: bool | None = None, **experiment_config: Any) -> None:
        super().__init__(log_dir, run_name)
        self.project = project
        self.workspace = workspace
        self.online = online
        self.experiment_config = experiment_config
        self._experiment: Any = None

    @property
    def experiment(self) -> Any:
        """The Comet experiment, started on first use."""
        if self._experiment is None:
            import comet_ml  # function-local: startup time (about two seconds), and it is optional

            for handler in logging.getLogger("comet_ml").handlers:  # its auto-logging is off: the hint is not
                if not any(isinstance(f, _NoLateImportHint) for f in handler.filters):
                    handler.addFilter(_NoLateImportHint())
            online = self.online
            if online is None and "COMET_START_ONLINE" not in os.environ:
                online = bool(comet_ml.config.get_api_key(None, comet_ml.get_config()))
            settings: dict[str, Any] = {"auto_param_logging": False, "auto_metric_logging": False, "parse_args": False,
                                        "display_summary_level": 0, "name": self.run_name,
                                        "offline_directory": os.path.abspath(os.path.join(self.log_dir or ".", FOLDER))}
            settings.update(self.experiment_config)
            earlier = self.resumed_run()
            key = earlier.get("experiment_key") if earlier else None  # a resumed paratrain run continues it
            self._experiment = comet_ml.start(project_name=self.project, workspace=self.workspace, online=online,
                                              experiment_key=key, mode="get_or_create" if key else "create",
                                              experiment_config=comet_ml.ExperimentConfig(**settings))
            self.remember_run({"experiment_key": self._experiment.get_key(), "project": self.project})
        return self._experiment

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.experiment.log_parameters(flatten(config))

    def log_metrics(self, metrics: Mapping[str, Any], step: int, kind: str) -> None:
        values = numeric(metrics)
        if values:
            self.experiment.log_metrics({f"{kind}/{k}": v for k, v in values.items()}, step=step)

    def log_image(self, name: str, image: Any, step: int, kind: str) -> None:
        # PNG bytes: Comet's own conversion of an array needs Pillow and fails on some (it drops them with a log line)
        self.experiment.log_image(io.BytesIO(png_bytes(image)), name=f"{kind}/{name}", step=step)

    def log_histogram(self, name: str, values: Any, step: int, kind: str) -> None:
        self.experiment.log_histogram_3d(values, name=f"{kind}/{name}", step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int, kind: str) -> None:
        self.experiment.log_table(media_file(kind, name, step, ".csv"), tabular_data=rows, headers=columns)

    def close(self, ok: bool = True) -> None:
        if self._experiment is not None:
            if not ok:
                self._experiment.log_other("paratrain_status", "failed")
            self._experiment.end()
            self._experiment = None


class _NoLateImportHint(logging.Filter):
    """Drops Comet's "import comet_ml before torch" hint: it is about the auto-logging paratrain turns off."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "import comet_ml before" not in record.getMessage()
