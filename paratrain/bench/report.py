"""Seed 000's results table, extended, plus JSON, CSV and a PNG chart of a bench run."""

from __future__ import annotations

import csv
import io
import json
import math
import os

from ..loop.logging import write_atomic
from .matrix import BASELINE
from .runner import BenchResult, CellResult, reference

__all__ = ["format_table", "write_json", "write_csv", "write_chart", "write_all"]

_COLUMNS = ("configuration", "s/epoch", "samples/s", "speed-up", "effic.", "peak MiB", "comm/step", "skips",
            "loss", "test acc")
_SECTIONS = (
    ("matrix", "strategies x world sizes x precisions x comm hooks"),
    ("baseline", "hand-written plain-PyTorch DDP loop (overhead reference)"),
    ("trap", "effective-batch trap: a per-worker batch kept fixed while workers are added grows the global batch "
             "(DDP on 4 GPUs with 4x256 samples per step once fell from 27% to 14% test accuracy this way)"),
)
_MEMORY = {"rss": "peak resident set size over the timed steps (VmHWM, reset after warm-up)",
           "rss-lifetime": "peak resident set size of the process (getrusage)",
           "cuda-max-allocated": "torch.cuda.max_memory_allocated over the timed steps"}


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _bytes(v: float | None) -> str:
    if v is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return "-"


def _cells(r: CellResult) -> list[str]:
    if r.status != "ok":
        return [r.cell.label, f"{r.status}: {r.reason}"]
    acc = None if r.test_accuracy is None else 100 * r.test_accuracy
    return [r.cell.label, _num(r.seconds_per_epoch, ".2f"), _num(r.samples_per_s, ",.0f"),
            _num(r.speedup, ".2f") + ("x" if r.speedup else ""),
            _num(None if r.efficiency is None else 100 * r.efficiency, ".0f") + ("%" if r.efficiency else ""),
            _num(r.peak_mem_mib, ".0f"), _bytes(r.comm_bytes_per_step) if r.cell.world_size > 1 else "-",
            str(r.skipped_steps), _num(r.final_loss, ".4f"), _num(acc, ".1f") + ("%" if acc is not None else "")]


def _header(res: BenchResult) -> list[str]:
    m, mach, spec = res.meta, res.meta["machine"], res.meta["spec"]
    device = f"{mach['gpus']} x {mach['gpu']}" if mach["gpus"] else f"CPU only, {spec['threads']} thread(s) per process"
    load = mach.get("load_avg_start")
    return [
        f"paratrain bench: {m['model']} on {m['dataset']} ({m['train_size']} training samples), global batch "
        f"{m['global_batch']}, {m['optimizer']} lr {m['lr']}, {spec['epochs']} epoch(s) per cell",
        f"machine: {mach['cpu']} ({mach['logical_cores']} logical cores), {device}; torch {mach['torch']}"
        + (f"; load average {load:.1f} at start" if load is not None else ""),
        f"timing: {spec['warmup_steps']} warm-up steps excluded, step time of the slowest rank, 1 run per cell "
        f"(fresh processes each); time per epoch = {m.get('timing', 'median step')} time x steps per epoch",
        f"memory: {_MEMORY.get(m.get('memory') or '', 'n/a')}, largest over ranks",
        "comm/step: payload of the busiest rank per optimizer step (all-reduce size; gather output; reduce-scatter "
        "input; pipeline: activations and gradients sent; ps: gradient pushed + parameters pulled)",
    ]


def format_table(res: BenchResult) -> str:
    """The table as text: a header, one section per cell group, overhead and recommendation lines."""
    lines = _header(res)
    rows = [(r, _cells(r)) for r in res.results]
    width = [max([len(_COLUMNS[i])] + [len(c[i]) for r, c in rows if r.status == "ok"]) for i in range(len(_COLUMNS))]
    width[0] = max(width[0], *(len(c[0]) for _, c in rows)) if rows else width[0]

    def line(cells: list[str]) -> str:
        if len(cells) == 2:  # skipped or failed: the reason spans the numeric columns
            return f"{cells[0]:<{width[0]}}  {cells[1]}"
        return "  ".join(f"{c:<{width[0]}}" if i == 0 else f"{c:>{width[i]}}" for i, c in enumerate(cells))

    for group, title in _SECTIONS:
        section = [c for r, c in rows if r.cell.group == group]
        if not section:
            continue
        lines += ["", f"== {title}", line(list(_COLUMNS)), "-" * (sum(width) + 2 * (len(width) - 1))]
        lines += [line(c) for c in section]
        if group == "trap":
            lines += [f"   {r.cell.label}: {r.cell.note}" for r in res.results if r.cell.group == "trap"]
    lines += [""] + _overhead_lines(res)
    rec = res.recommendation
    tol = res.meta["spec"]["tolerance"]
    if rec is None and reference(res.results) is None:
        lines.append("recommendation: none (no single-device run to compare accuracy with: add single to --strategies)")
    elif rec is None:
        lines.append(f"recommendation: none (no configuration ran with accuracy within {100 * tol:.1f} points "
                     "of single)")
    else:
        lines.append(f"recommendation: {rec.cell.label} — fastest configuration whose test accuracy "
                     f"({100 * (rec.test_accuracy or 0):.1f}%) is within {100 * tol:.1f} points of single's "
                     f"({rec.seconds_per_epoch:.2f} s/epoch, {_num(rec.speedup, '.2f')}x)")
    skipped = sum(r.status != "ok" for r in res.results)
    if skipped:
        lines.append(f"{skipped} cell(s) did not run here; each is listed with the reason")
    return "\n".join(lines)


def _overhead_lines(res: BenchResult) -> list[str]:
    return [f"overhead: paratrain ddp x{r.cell.world_size} takes {r.overhead.describe()} the hand-written loop's "
            "step time, the two interleaved in the same processes" for r in res.results
            if r.cell.strategy == BASELINE and r.status == "ok" and r.overhead is not None]


def write_json(res: BenchResult, path: str) -> None:
    obj = {"meta": res.meta, "cells": [r.row() for r in res.results],
           "recommendation": None if res.recommendation is None else res.recommendation.cell.label}
    write_atomic(path, json.dumps(obj, indent=2, default=str))


def write_csv(res: BenchResult, path: str) -> None:
    rows = [r.row() for r in res.results]
    fields = list(rows[0]) if rows else ["label"]
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, out.getvalue())


def write_chart(res: BenchResult, path: str) -> bool:
    """Throughput and scaling efficiency per configuration as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in res.results if r.status == "ok"]
    colors = {"matrix": "tab:blue", "baseline": "tab:gray", "trap": "tab:orange"}
    labels = [r.cell.label for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * max(len(ok), 3) + 1.6), sharey=True)
    y = list(range(len(ok)))
    axes[0].barh(y, [r.samples_per_s or 0 for r in ok], color=[colors[r.cell.group] for r in ok])
    axes[0].set_xlabel("samples/s (higher is better)")
    axes[0].set_yticks(y, labels)
    axes[0].invert_yaxis()
    axes[1].barh(y, [100 * (r.efficiency or 0) for r in ok], color=[colors[r.cell.group] for r in ok])
    axes[1].axvline(100, color="k", lw=0.8, ls="--")
    axes[1].set_xlabel("scaling efficiency % (speed-up / workers)")
    for i, r in enumerate(ok):
        if r.test_accuracy is not None:
            axes[1].text(100 * (r.efficiency or 0) + 1, i, f"acc {100 * r.test_accuracy:.1f}%", va="center", fontsize=8)
    skipped = len(res.results) - len(ok)
    m = res.meta
    fig.suptitle(f"paratrain bench: {m['model']} on {m['dataset']}, global batch {m['global_batch']}"
                 + (f" ({skipped} cell(s) not run: see the table)" if skipped else ""))
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    write_atomic(path, png.getvalue())
    plt.close(fig)
    return True


def write_all(res: BenchResult, out_dir: str) -> dict[str, str]:
    """results.json, results.csv and chart.png (when matplotlib is installed) in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "results.json"), "csv": os.path.join(out_dir, "results.csv")}
    write_json(res, paths["json"])
    write_csv(res, paths["csv"])
    chart = os.path.join(out_dir, "chart.png")
    if write_chart(res, chart):
        paths["chart"] = chart
    return paths
