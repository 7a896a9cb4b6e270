"""``mlflow``: an MLflow run; without ``MLFLOW_TRACKING_URI`` a SQLite store, ``<log_dir>/mlflow.db``
(artifacts in ``<log_dir>/mlartifacts``). A resumed paratrain run continues the same MLflow run (its
id is kept in the run folder)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import tempfile
import time
import warnings
from collections.abc import Mapping
from typing import Any

from .base import Tracker, flatten, numeric
from .media import histogram_summary, media_file, png_bytes

__all__ = ["MLflowTracker", "DATABASE", "ARTIFACTS"]

DATABASE = "mlflow.db"
"""The default store in the log folder: ``sqlite:///<log_dir>/mlflow.db``."""
ARTIFACTS = "mlartifacts"
"""Where that store's runs keep their artifacts (images, histograms, tables): ``<log_dir>/mlartifacts``."""
_STORE_PACKAGES = ("sqlalchemy", "alembic")  # MLflow's SQL store needs them; mlflow has them, mlflow-skinny not


class MLflowTracker(Tracker):
    """Metrics as ``<kind>/<name>`` at the optimizer step, the config and provenance as params
    (flattened: ``parallel.seed``), in experiment ``experiment`` of ``tracking_uri``.

    ``tracking_uri`` defaults to ``MLFLOW_TRACKING_URI``, else ``sqlite:///<log_dir>/mlflow.db``
    (with ``sqlalchemy`` and ``alembic`` installed, as ``pip install mlflow`` has them; MLflow
    deprecates the file store), else, with a one-line warning, the file store ``<log_dir>/mlruns``.
    A run an older paratrain started in ``<log_dir>/mlruns`` continues there when resumed.

    Images go through ``MlflowClient.log_image`` with their key and step (the run's image grid;
    without Pillow as ``images/<kind>/<name>/step-XXXXXXXX.png``), tables as ``log_table`` JSON
    (``tables/<kind>/<name>/step-XXXXXXXX.json``), histograms, which MLflow has not, as JSON
    artifacts ``histograms/<kind>/<name>/step-XXXXXXXX.json`` (``bins`` edges and ``counts``).

    Uses ``MlflowClient`` (:attr:`experiment`; the run is ``run_id``): no global active run is
    left behind in the user's process."""

    name = "mlflow"
    package = "mlflow"

    def __init__(self, log_dir: str | None = None, run_name: str | None = None, experiment: str = "paratrain",
                 tracking_uri: str | None = None) -> None:
        super().__init__(log_dir, run_name)
        self.experiment_name = experiment
        self.tracking_uri = tracking_uri
        self.client: Any = None
        self.run_id: str | None = None
        self._logged: set[str] = set()  # params the run already has (a resumed run: MLflow refuses changes)

    def default_uri(self) -> str:
        """Where the run goes without ``tracking_uri`` and ``MLFLOW_TRACKING_URI``."""
        folder = os.path.abspath(self.log_dir or ".")
        earlier = self.resumed_run() or {}
        if str(earlier.get("tracking_uri", "")).startswith("file:"):  # started by an older paratrain: go on there
            return str(earlier["tracking_uri"])
        if all(importlib.util.find_spec(p) is not None for p in _STORE_PACKAGES):
            return "sqlite:///" + os.path.join(folder, DATABASE)
        warnings.warn("mlflow: without sqlalchemy and alembic the run goes to MLflow's deprecated file store "
                      f"{os.path.join(folder, 'mlruns')}: pip install sqlalchemy alembic (or mlflow) for "
                      f"{os.path.join(folder, DATABASE)}", stacklevel=2)
        return "file:" + os.path.join(folder, "mlruns")

    def _start(self) -> None:
        # function-local: startup time (mlflow's import takes over a second), and it is optional
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None  # empty: unset
        ours = uri is None
        if uri is None:
            uri = self.default_uri()
            if uri.startswith("file:"):  # MLflow 3 refuses a file store unless asked for: this one is on purpose
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        if uri.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(uri[len("sqlite:///"):]) or ".", exist_ok=True)
        self.client = MlflowClient(uri)
        earlier = self.resumed_run()
        if earlier and earlier.get("tracking_uri") == uri:  # a resumed paratrain run continues its MLflow run
            self.run_id = earlier["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self._logged = set(self.client.get_run(self.run_id).data.params)
            return
        found = self.client.get_experiment_by_name(self.experiment_name)
        if found:
            experiment_id = found.experiment_id
        else:  # in paratrain's own database the artifacts stay in the log folder too (not ./mlruns of the cwd)
            location = pathlib.Path(self.log_dir or ".", ARTIFACTS).resolve().as_uri() if ours and uri.startswith("sqlite") else None
            experiment_id = self.client.create_experiment(self.experiment_name, artifact_location=location)
        self.run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
        self.remember_run({"run_id": self.run_id, "tracking_uri": uri})

    @property
    def experiment(self) -> Any:
        """The ``MlflowClient`` (its run: ``run_id``), the run started if it was not yet."""
        if self.run_id is None:
            self._start()
        return self.client

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param  # function-local: mlflow is optional

        if self.run_id is None:
            self._start()
        params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items() if k not in self._logged]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, Any], step: int, kind: str) -> None:
        from mlflow.entities import Metric  # function-local: mlflow is optional

        if self.run_id is None:
            self._start()
        now = int(time.time() * 1000)
        batch = [Metric(f"{kind}/{k}", v, now, step) for k, v in numeric(metrics).items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_image(self, name: str, image: Any, step: int, kind: str) -> None:
        client = self.experiment
        if importlib.util.find_spec("PIL") is not None:
            client.log_image(self.run_id, image[:, :, 0] if image.shape[2] == 1 else image, key=f"{kind}/{name}", step=step)
        else:
            self._artifact(kind, name, step, ".png", png_bytes(image))

    def log_histogram(self, name: str, values: Any, step: int, kind: str) -> None:
        self.experiment.log_dict(self.run_id, histogram_summary(values), "histograms/" + media_file(kind, name, step, ".json"))

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int, kind: str) -> None:
        path = "tables/" + media_file(kind, name, step, ".json")
        if importlib.util.find_spec("pandas") is not None:  # log_table builds a DataFrame (and lists it for the UI)
            import pandas  # function-local: optional (mlflow-skinny does not need it)

            self.experiment.log_table(self.run_id, pandas.DataFrame(rows, columns=columns), path)
        else:  # the same file log_table writes
            self.experiment.log_dict(self.run_id, {"columns": columns, "data": rows}, path)

    def _artifact(self, kind: str, name: str, step: int, suffix: str, data: bytes) -> None:
        relative = media_file(kind, name, step, suffix)
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, os.path.basename(relative))
            with open(local, "wb") as f:
                f.write(data)
            self.client.log_artifact(self.run_id, local, "images/" + os.path.dirname(relative))

    def close(self, ok: bool = True) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")
            self.run_id = None
