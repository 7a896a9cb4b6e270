"""``csv``: one row per record in ``<log_dir>/<kind>.csv`` and ``<kind>.jsonl``."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping
from typing import Any

from .base import Tracker

__all__ = ["CSVTracker"]


class CSVTracker(Tracker):
    """CSV and JSON lines, one file pair per kind (``train.csv``, ``eval.jsonl``). The CSV columns
    are the first record's; later keys go to the JSONL file only."""

    name = "csv"

    def __init__(self, log_dir: str | None = None, run_name: str | None = None) -> None:
        super().__init__(log_dir, run_name)
        self._fields: dict[str, list[str]] = {}

    def log_metrics(self, metrics: Mapping[str, Any], step: int, kind: str) -> None:
        if self.log_dir is None:
            raise ValueError("the csv tracker needs a log_dir")
        os.makedirs(self.log_dir, exist_ok=True)
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        path = os.path.join(self.log_dir, kind)
        first = kind not in self._fields
        if first and self.append and os.path.exists(path + ".csv"):  # a resumed run continues its files
            with open(path + ".csv", newline="") as f:
                self._fields[kind] = next(csv.reader(f), []) or list(record)
            first = False
        fields = self._fields.setdefault(kind, list(record))
        with open(path + ".jsonl", "w" if first else "a") as f:
            f.write(json.dumps(record) + "\n")
        with open(path + ".csv", "w" if first else "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore", restval="")
            if first:
                writer.writeheader()
            writer.writerow(record)


def _plain(value: Any) -> Any:
    """A one-element tensor as its number (what json can write)."""
    return value.item() if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1 else value
