"""``mlflow``: an MLflow run; without ``MLFLOW_TRACKING_URI`` a file store in ``<log_dir>/mlruns``. A
resumed paratrain run continues the same MLflow run (its id is kept in the run folder)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from .base import Tracker, flatten, numeric

__all__ = ["MLflowTracker"]


class MLflowTracker(Tracker):
    """Metrics as ``<kind>/<name>`` at the optimizer step, the config and provenance as params
    (flattened: ``parallel.seed``), in experiment ``experiment`` of ``tracking_uri`` (default:
    ``MLFLOW_TRACKING_URI``, else ``file:<log_dir>/mlruns``). Uses ``MlflowClient``: no global
    active run is left behind in the user's process."""

    name = "mlflow"
    package = "mlflow"

    def __init__(self, log_dir: str | None = None, run_name: str | None = None, experiment: str = "paratrain",
                 tracking_uri: str | None = None) -> None:
        super().__init__(log_dir, run_name)
        self.experiment = experiment
        self.tracking_uri = tracking_uri
        self.client: Any = None
        self.run_id: str | None = None
        self._logged: set[str] = set()  # params the run already has (a resumed run: MLflow refuses changes)

    def _start(self) -> None:
        # function-local: startup time (mlflow's import takes over a second), and it is optional
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None  # empty: unset
        if uri is None:
            uri = "file:" + os.path.abspath(os.path.join(self.log_dir or ".", "mlruns"))
            # MLflow 3 refuses a file store unless asked for: this local default is one on purpose
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self.client = MlflowClient(uri)
        earlier = self.resumed_run()
        if earlier and earlier.get("tracking_uri") == uri:  # a resumed paratrain run continues its MLflow run
            self.run_id = earlier["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self._logged = set(self.client.get_run(self.run_id).data.params)
            return
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
        self.remember_run({"run_id": self.run_id, "tracking_uri": uri})

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

    def close(self, ok: bool = True) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")
            self.run_id = None
