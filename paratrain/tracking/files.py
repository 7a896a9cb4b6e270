"""``csv``: one row per record in ``<log_dir>/<kind>.csv`` and ``<kind>.jsonl``; images, histograms
and tables as lines of ``<log_dir>/media.jsonl`` (images and tables in files under ``media/``)."""

from __future__ import annotations

import csv
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from .base import Tracker, scalar
from .media import histogram_summary, media_file, png_bytes

__all__ = ["CSVTracker"]


class CSVTracker(Tracker):
    """CSV and JSON lines, one file pair per kind (``train.csv``, ``eval.jsonl``). The CSV columns
    are the first record's; later keys go to the JSONL file only.

    Images, histograms and tables: one line each in ``media.jsonl`` (``step``, ``kind``, ``name``,
    ``type``), an image written as ``media/<kind>/<name>/step-XXXXXXXX.png`` and a table as
    ``....csv`` (the line's ``path``, relative to the log folder), a histogram in the line itself
    (``min``, ``max``, ``num``, ``sum``, 64 ``counts`` between 65 ``bins`` edges)."""

    name = "csv"
    MEDIA = "media"

    def __init__(self, log_dir: str | None = None, run_name: str | None = None) -> None:
        super().__init__(log_dir, run_name)
        self._fields: dict[str, list[str]] = {}
        self._warned: set[tuple[str, str]] = set()
        self._media_started = False

    def log_image(self, name: str, image: Any, step: int, kind: str) -> None:
        path = self._media_path(kind, name, step, ".png")
        with open(path, "wb") as f:
            f.write(png_bytes(image))
        self._media({"step": step, "kind": kind, "name": name, "type": "image", "path": self._relative(path)})

    def log_histogram(self, name: str, values: Any, step: int, kind: str) -> None:
        self._media({"step": step, "kind": kind, "name": name, "type": "histogram", **histogram_summary(values)})

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int, kind: str) -> None:
        path = self._media_path(kind, name, step, ".csv")
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            writer.writerows(rows)
        self._media({"step": step, "kind": kind, "name": name, "type": "table", "path": self._relative(path)})

    def _media_path(self, kind: str, name: str, step: int, suffix: str) -> str:
        if self.log_dir is None:
            raise ValueError("the csv tracker needs a log_dir")
        path = os.path.join(self.log_dir, self.MEDIA, *media_file(kind, name, step, suffix).split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def _relative(self, path: str) -> str:
        return os.path.relpath(path, self.log_dir or ".").replace(os.sep, "/")

    def _media(self, record: dict[str, Any]) -> None:
        if self.log_dir is None:
            raise ValueError("the csv tracker needs a log_dir")
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, self.MEDIA)
        if not self._media_started:
            self._media_started = True
            if not self.append and os.path.exists(path + ".jsonl"):
                os.remove(path + ".jsonl")
            elif self.append and self.resume_step is not None:
                _drop_after(path, self.resume_step)
        with open(path + ".jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

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
            if self.resume_step is not None:  # what the interrupted run logged after its checkpoint comes again
                _drop_after(path, self.resume_step)
            first = False
        fields = self._fields.setdefault(kind, list(record))
        new = [k for k in record if k not in fields and (kind, k) not in self._warned]
        if new:
            self._warned.update((kind, k) for k in new)
            warnings.warn(f"{kind}.csv keeps the columns of its first record: {', '.join(new)} go to {kind}.jsonl "
                          "only (log every key from the first record on to have it in the CSV)", stacklevel=3)
        with open(path + ".jsonl", "w" if first else "a") as f:
            f.write(json.dumps(record) + "\n")
        with open(path + ".csv", "w" if first else "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore", restval="")
            if first:
                writer.writeheader()
            writer.writerow(record)


def _drop_after(path: str, step: int) -> None:
    """Keep the rows of ``path``.csv and ``path``.jsonl up to ``step`` (rewritten atomically)."""
    for suffix in (".csv", ".jsonl"):
        if not os.path.exists(path + suffix):
            continue
        with open(path + suffix, newline="") as f:
            lines = f.readlines()
        if suffix == ".csv":
            kept = lines[:1] + [line for line, row in zip(lines[1:], csv.DictReader(lines)) if _at_most(row.get("step"), step)]
        else:
            kept = [line for line in lines if line.strip() and _at_most(json.loads(line).get("step"), step)]
        if len(kept) != len(lines):
            tmp = f"{path}{suffix}.tmp-{os.getpid()}"
            with open(tmp, "w", newline="") as f:
                f.writelines(kept)
            os.replace(tmp, path + suffix)


def _at_most(value: Any, step: int) -> bool:
    try:
        return int(float(value)) <= step
    except (TypeError, ValueError):
        return True  # not a step: kept


def _plain(value: Any) -> Any:
    """What json can write: a one-element tensor or a NumPy number as its number; a larger tensor
    or array as a list."""
    value = scalar(value)
    return value.tolist() if hasattr(value, "tolist") else value
