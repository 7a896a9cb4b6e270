"""The strategies' results table plus JSON, CSV and a PNG chart of a bench run."""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass, replace

from ..loop.logging import write_atomic
from .matrix import BASELINE
from .runner import BenchResult, CellResult, reference

__all__ = ["format_table", "write_json", "write_csv", "write_chart", "write_all", "Bar", "chart_bars", "legend_entries"]

_COLUMNS = ("configuration", "s/epoch", "samples/s", "speed-up", "effic.", "peak MiB", "comm/step", "skips",
            "loss", "test acc")
_SECTIONS = (
    ("matrix", "strategies x world sizes x precisions x comm hooks"),
    ("mesh", "composed layouts (pp x dp_replicate x dp_shard x tp), beside the strategies"),
    ("baseline", "hand-written plain-PyTorch DDP loop (overhead reference)"),
    ("trap", "effective-batch trap: a per-worker batch kept fixed while workers are added grows the global batch "
             "(DDP on 4 GPUs with 4x256 samples per step once fell from 27% to 14% test accuracy this way)"),
)
_MEMORY = {"rss": "peak resident set size over the timed steps (VmHWM, reset after warm-up)",
           "rss-lifetime": "peak resident set size of the process (getrusage)",
           "cuda-max-allocated": "torch.cuda.max_memory_allocated over the timed steps"}


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _seconds(v: float | None) -> str:
    """Seconds with two decimals, or three significant digits below 0.1 s (a tiny model's epoch)."""
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.2f}" if v >= 0.1 else f"{v:.3g}"


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
    return [r.cell.label, _seconds(r.seconds_per_epoch), _num(r.samples_per_s, ",.0f"),
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
        lines += [f"   {r.cell.label}: " + ", ".join(f"{d} {_bytes(b)}" for d, b in sorted(r.comm_by_dimension.items()))
                  + " per step" for r, _ in rows if r.cell.group == group and r.comm_by_dimension
                  and (r.cell.mesh or len(r.comm_by_dimension) > 1)]
        if group == "trap":
            lines += [f"   {r.cell.label}: {r.cell.note}" for r in res.results if r.cell.group == "trap"]
    lines += [""] + _overhead_lines(res)
    rec = res.recommendation
    tol = res.meta["spec"]["tolerance"]
    if rec is None and reference(res.results) is None:
        single_ran = any(r.cell.strategy_class.reference for r in res.results)
        lines.append("recommendation: none (" + ("the single-device run did not succeed (see its row), so there is"
                                                 " no accuracy to compare with)" if single_ran else
                                                 "no single-device run to compare accuracy with: add single to "
                                                 "--strategies)"))
    elif rec is None:
        lines.append(f"recommendation: none (no configuration ran with accuracy within {100 * tol:.1f} points "
                     "of single)")
    else:
        lines.append(f"recommendation: {rec.cell.label} — fastest configuration whose test accuracy "
                     f"({100 * (rec.test_accuracy or 0):.1f}%) is within {100 * tol:.1f} points of single's "
                     f"({_seconds(rec.seconds_per_epoch)} s/epoch, {_num(rec.speedup, '.2f')}x)")
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
    for row in rows:  # a column of its own per dimension's bytes: comm_bytes_pp, comm_bytes_dp_shard...
        row.update({f"comm_bytes_{d}": b for d, b in (row.pop("comm_by_dimension", None) or {}).items()})
    fields = list(dict.fromkeys(k for row in rows for k in row)) if rows else ["label"]
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, out.getvalue())


_GROUPS = {"matrix": ("tab:blue", "matrix cells"), "mesh": ("tab:green", "composed layouts"),
           "baseline": ("tab:gray", "hand-written baseline"),
           "trap": ("tab:orange", "effective-batch cells")}
_GAP = ("none", "not run here (gap, reason on the bar's line)")


@dataclass(frozen=True)
class Bar:
    """One row of chart.png: a measured cell, or a gap (``samples_per_s`` None) saying why a cell did not run."""

    label: str
    group: str
    samples_per_s: float | None = None
    efficiency: float | None = None
    """Speed-up / workers, a fraction."""
    note: str = ""
    """Beside the efficiency bar: the test accuracy; for a gap the reason."""


def chart_bars(results: list[CellResult], width: int = 70) -> list[Bar]:
    """The chart's rows in table order: cells that trained identically (same run key: the trap's
    same-batch cell is the matrix's ddp cell) are one bar with both labels; cells that did not run
    are gaps labelled with the reason, cut to ``width`` characters."""
    bars: list[Bar] = []
    measured: dict[tuple[object, ...], int] = {}
    for r in results:
        if r.status != "ok":
            reason = f"{r.status}: {r.reason or ''}"
            bars.append(Bar(label=r.cell.label, group=r.cell.group,
                            note=reason if len(reason) <= width else reason[: width - 1] + "…"))
            continue
        key = r.cell.run_key()
        if key in measured:
            i = measured[key]
            bars[i] = replace(bars[i], label=f"{bars[i].label} = {r.cell.label}")
            continue
        measured[key] = len(bars)
        bars.append(Bar(label=r.cell.label, group=r.cell.group, samples_per_s=r.samples_per_s or 0.0,
                        efficiency=r.efficiency or 0.0,
                        note="" if r.test_accuracy is None else f"acc {100 * r.test_accuracy:.1f}%"))
    return bars


def legend_entries(bars: list[Bar]) -> list[tuple[str, str]]:
    """(colour, text) for each kind of bar the chart shows, in a fixed order; the gap last."""
    shown = {b.group for b in bars if b.samples_per_s is not None}
    out = [_GROUPS[g] for g in _GROUPS if g in shown]
    return out + ([_GAP] if any(b.samples_per_s is None for b in bars) else [])


def write_chart(res: BenchResult, path: str) -> bool:
    """Throughput and scaling efficiency per configuration as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    bars = chart_bars(res.results)
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.42 * max(len(bars), 3) + 2.2), sharey=True)
    y = list(range(len(bars)))
    color = [_GROUPS[b.group][0] for b in bars]
    axes[0].barh(y, [b.samples_per_s or 0 for b in bars], color=color)
    axes[0].set_xlabel("samples/s (higher is better)")
    axes[0].set_yticks(y, [b.label for b in bars])
    axes[0].invert_yaxis()
    axes[1].barh(y, [100 * (b.efficiency or 0) for b in bars], color=color)
    axes[1].axvline(100, color="k", lw=0.8, ls="--")
    axes[1].set_xlabel("scaling efficiency % (speed-up / workers)")
    for i, b in enumerate(bars):
        if b.samples_per_s is None:  # a gap: the reason where the bars would be
            axes[0].text(0, i, f" {b.note}", va="center", fontsize=7, color="0.35", style="italic")
            axes[0].get_yticklabels()[i].set_color("0.45")
        elif b.note:
            axes[1].text(100 * (b.efficiency or 0) + 1, i, b.note, va="center", fontsize=8)
    handles = [Patch(facecolor=c, edgecolor="0.5" if c == "none" else c, label=t) for c, t in legend_entries(bars)]
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=9)
    skipped = sum(b.samples_per_s is None for b in bars)
    m = res.meta
    fig.suptitle(f"paratrain bench: {m['model']} on {m['dataset']}, global batch {m['global_batch']}"
                 + (f" ({skipped} cell(s) not run here: gaps)" if skipped else ""))
    fig.tight_layout(rect=(0, 0.06 if handles else 0, 1, 1))
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
