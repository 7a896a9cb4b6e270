"""``wandb``: a Weights & Biases run (``WANDB_MODE=offline`` keeps it on disk, in ``<log_dir>/wandb``);
a resumed paratrain run continues the same wandb run (its id is kept in the run folder)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import Tracker, numeric

__all__ = ["WandbTracker"]


class WandbTracker(Tracker):
    """Metrics as ``<kind>/<name>`` at the optimizer step; the config and provenance as the run's
    config. ``project`` and further ``wandb.init`` arguments (``entity``, ``tags``, ``mode``) as keywords.
    Images, histograms and tables as ``wandb.Image``, ``wandb.Histogram`` and ``wandb.Table``, in the
    step's row (W&B keeps steps in order: a step below one already logged is dropped, with W&B's
    warning). :attr:`experiment` (and :attr:`run`) is the wandb run."""

    name = "wandb"
    package = "wandb"

    def __init__(self, log_dir: str | None = None, run_name: str | None = None, project: str = "paratrain",
                 **init_kwargs: Any) -> None:
        super().__init__(log_dir, run_name)
        self.project = project
        self.init_kwargs = init_kwargs
        self._config: dict[str, Any] = {}
        self._run: Any = None

    @property
    def run(self) -> Any:
        """The ``wandb`` run, started on first use (on the main process: paratrain calls nothing elsewhere)."""
        if self._run is None:
            import wandb  # function-local: startup time (about a second), and it is optional

            kwargs = dict(self.init_kwargs)
            earlier = self.resumed_run()
            if earlier and "id" not in kwargs:  # a resumed paratrain run continues its wandb run
                kwargs.update(id=earlier["id"], resume="allow")
            self._run = wandb.init(project=self.project, name=self.run_name, dir=self.log_dir,
                                   config=self._config, **kwargs)
            self.remember_run({"id": self._run.id, "project": self.project})
        return self._run

    def log_config(self, config: Mapping[str, Any]) -> None:
        if self._run is None:
            self._config = dict(config)  # goes to wandb.init: no config update after the start
        else:
            self._run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, Any], step: int, kind: str) -> None:
        self.run.log({f"{kind}/{k}": v for k, v in numeric(metrics).items()}, step=step)

    def log_image(self, name: str, image: Any, step: int, kind: str) -> None:
        import wandb  # function-local: optional

        self.run.log({f"{kind}/{name}": wandb.Image(image[:, :, 0] if image.shape[2] == 1 else image)}, step=step)

    def log_histogram(self, name: str, values: Any, step: int, kind: str) -> None:
        import wandb  # function-local: optional

        self.run.log({f"{kind}/{name}": wandb.Histogram(values)}, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int, kind: str) -> None:
        import wandb  # function-local: optional

        header: list[str | int] = list(columns)
        self.run.log({f"{kind}/{name}": wandb.Table(columns=header, data=rows, allow_mixed_types=True)}, step=step)

    @property
    def experiment(self) -> Any:
        return self.run

    def close(self, ok: bool = True) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if ok else 1)
            self._run = None
