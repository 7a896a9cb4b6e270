"""``tensorboard``: each numeric value as a scalar ``<kind>/<name>`` in ``<log_dir>/tensorboard``; images
and histograms as TensorBoard's own, tables as Markdown text."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from .base import Tracker, numeric
from .media import markdown_table

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker(Tracker):
    """Scalars, images (Pillow encodes them) and histograms as ``<kind>/<name>``; a table as
    Markdown text (the Text tab shows it as a table). :attr:`experiment` is the ``SummaryWriter``."""

    name = "tensorboard"
    package = "tensorboard"

    def __init__(self, log_dir: str | None = None, run_name: str | None = None) -> None:
        super().__init__(log_dir, run_name)
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        """torch's ``SummaryWriter``, made on first use."""
        if self._writer is None:
            # function-local: startup time (tensorboard's import costs about a second, and it is optional)
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run: events the interrupted run wrote after its checkpoint are dropped
            purge = self.resume_step + 1 if self.append and self.resume_step is not None else None
            self._writer = SummaryWriter(os.path.join(self.log_dir or "runs", "tensorboard"), purge_step=purge)
        return self._writer

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def log_metrics(self, metrics: Mapping[str, Any], step: int, kind: str) -> None:
        for name, value in numeric(metrics).items():
            self.writer.add_scalar(f"{kind}/{name}", value, step)

    def log_image(self, name: str, image: Any, step: int, kind: str) -> None:
        if image.shape[2] == 1:
            self.writer.add_image(f"{kind}/{name}", image[:, :, 0], step, dataformats="HW")
        else:
            self.writer.add_image(f"{kind}/{name}", image, step, dataformats="HWC")

    def log_histogram(self, name: str, values: Any, step: int, kind: str) -> None:
        self.writer.add_histogram(f"{kind}/{name}", values, step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int, kind: str) -> None:
        self.writer.add_text(f"{kind}/{name}", markdown_table(columns, rows), step)

    @property
    def experiment(self) -> Any:
        return self.writer

    def close(self, ok: bool = True) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
