"""What ``paratrain selftest`` found: rows of one table, printed, and written as JSON and Markdown."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Row", "Report", "OK", "FAIL", "SKIPPED"]

OK, FAIL, SKIPPED = "ok", "FAIL", "skipped"


@dataclass
class Row:
    """One check: its section, what it ran, ``ok``/``FAIL``/``skipped``, the result in a few words
    and the numbers behind it."""

    section: str
    check: str
    status: str
    result: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    facts: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    seed_table: list[dict[str, Any]] = field(default_factory=list)
    """The ResNet-50 comparison on this machine: one dict per configuration (see ``seed.py``)."""
    seed_note: str = ""
    budget_s: float = 0.0
    elapsed_s: float = 0.0

    def add(self, section: str, check: str, status: str, result: str = "", **data: Any) -> Row:
        row = Row(section, check, status, " ".join(result.split()), data)
        self.rows.append(row)
        return row

    @property
    def failed(self) -> list[Row]:
        """The failed correctness checks (of strategies and of layouts): these make the command exit non-zero."""
        return [r for r in self.rows if r.status == FAIL and r.section in ("correctness", "layouts")]

    @property
    def skipped(self) -> list[Row]:
        return [r for r in self.rows if r.status == SKIPPED]

    # ------------------------------------------------------------------ text
    def table(self) -> str:
        """The one table: every row, aligned, then the seed table and a summary line."""
        head = ("section", "check", "status", "result")
        body = [(r.section, r.check, r.status, r.result) for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
        widths[-1] = 0  # the result column is not padded
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head).rstrip(), fmt.format(*("-" * max(w, 6) for w in widths)).rstrip()]
        lines += [fmt.format(*row).rstrip() for row in body]
        if self.seed_table:
            lines += ["", self.seed_note, *_seed_lines(self.seed_table)]
        lines += ["", self.summary()]
        return "\n".join(lines)

    def summary(self) -> str:
        counts = {s: sum(r.status == s for r in self.rows) for s in (OK, FAIL, SKIPPED)}
        verdict = "FAIL" if self.failed else "PASS"
        return (f"selftest: {verdict}: {counts[OK]} ok, {counts[FAIL]} failed, {counts[SKIPPED]} skipped "
                f"in {self.elapsed_s:.0f} s of a {self.budget_s:.0f} s budget")

    def markdown(self) -> str:
        lines = ["# paratrain selftest", "", f"**{self.summary()}**", "", "## Machine", ""]
        lines += [f"- {k}: {_md(v)}" for k, v in self.facts.items()]
        lines += ["", "## Checks", "", "| section | check | status | result |", "|---|---|---|---|"]
        lines += [f"| {r.section} | {_md(r.check)} | {r.status} | {_md(r.result)} |" for r in self.rows]
        if self.seed_table:
            lines += ["", "## Single vs DataParallel vs DDP vs mixed precision on ResNet-50", "", self.seed_note, ""]
            lines += ["| configuration | " + " | ".join(_SEED_COLUMNS[1:]) + " |",
                      "|---" * len(_SEED_COLUMNS) + "|"]
            lines += ["| " + " | ".join(_md(c) for c in _seed_cells(row)) + " |" for row in self.seed_table]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "passed": not self.failed, "budget_s": self.budget_s,
                "elapsed_s": self.elapsed_s, "facts": self.facts, "rows": [asdict(r) for r in self.rows],
                "seed_table": self.seed_table, "seed_note": self.seed_note}

    def write(self, out_dir: str) -> dict[str, str]:
        """Write ``selftest.json`` and ``selftest.md`` into ``out_dir``; their paths."""
        os.makedirs(out_dir, exist_ok=True)
        paths = {"json": os.path.join(out_dir, "selftest.json"), "md": os.path.join(out_dir, "selftest.md")}
        with open(paths["json"], "w") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)
            f.write("\n")
        with open(paths["md"], "w") as f:
            f.write(self.markdown())
        return paths


_SEED_COLUMNS = ("configuration", "s/epoch", "samples/s", "speed-up", "peak MiB", "published s/epoch", "note")


def _seed_cells(row: dict[str, Any]) -> list[str]:
    def num(key: str, fmt: str) -> str:
        v = row.get(key)
        return "" if v is None else format(v, fmt)

    note = row.get("skip") or row.get("note") or ""
    return [row["label"], num("seconds_per_epoch", ".2f"), num("samples_per_s", ".0f"), num("speedup", ".2f"),
            num("peak_mem_mib", ".0f"), num("seed_seconds", ".1f"), note]


def _seed_lines(rows: list[dict[str, Any]]) -> list[str]:
    body = [_seed_cells(r) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(_SEED_COLUMNS, *body)]
    widths[-1] = 0
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*_SEED_COLUMNS).rstrip(), *(fmt.format(*b).rstrip() for b in body)]


def _md(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")
