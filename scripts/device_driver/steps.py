"""The steps' commands and what each reads off its log and files: the GPU-only checks
(``scripts/device_checks``), ``selftest`` and its seed table, ``bench --quick``, the loader and
predictor benchmarks; and the probe of the interpreter that runs them."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable

from .plan import OPTIONAL, SELFTEST_SECTIONS, Step, inner_budget
from .runner import Runner, tail_line, why_not

__all__ = ["ROOT", "Ctx", "PACKAGE_HINT", "COMMANDS", "command_for", "probe", "pre_skip"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = r"""
import importlib.util, json, os, platform, sys
import torch
out = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
       "cuda_build": torch.version.cuda, "cuda": torch.cuda.is_available(), "cores": os.cpu_count(),
       "gpus": [], "packages": {}}
if out["cuda"]:
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:
        out["nccl"] = f"unavailable: {e}"
for name in %r:
    try:
        out["packages"][name] = importlib.util.find_spec(name) is not None
    except Exception:
        out["packages"][name] = False
import paratrain
out["paratrain"] = paratrain.__version__
out["paratrain_from"] = os.path.dirname(paratrain.__file__)
print("PROBE " + json.dumps(out))
"""


@dataclass
class Ctx:
    python: str
    out: str
    dry: bool
    probe: dict[str, Any]
    seed_table_ok: bool = False
    """The seed_table step ran its rows: selftest then skips its own resnet50 section."""
    lm_ok: bool = False
    """The lm step ran its rows: selftest then skips its own lm section."""

    @property
    def logs(self) -> str:
        """OUT/logs: each step's log and what it writes, below the summaries."""
        return os.path.join(self.out, "logs")

    @property
    def mode(self) -> str:
        return "cpu" if self.dry else "gpu"


def _check_cmd(ctx: Ctx, name: str, slice_s: float) -> list[str]:
    return [ctx.python, os.path.join(ROOT, "scripts", "device_checks"), name, "--mode", ctx.mode,
            "--budget", f"{slice_s:.0f}", "--result", os.path.join(ctx.logs, f"{name}.result.json")]


def _read_check(ctx: Ctx, name: str, code: int | None, log: str) -> tuple[str, str, dict[str, Any]]:
    path = os.path.join(ctx.logs, f"{name}.result.json")
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        return "failed", f"exit {code}, no result: {tail_line(log, r'Error|error|failed')}", {}
    return res["status"], res.get("summary") or res.get("reason") or "", res.get("details", {})


def _selftest_cmd(ctx: Ctx, slice_s: float) -> list[str]:
    cmd = [ctx.python, "-m", "paratrain", "selftest", "--budget", f"{inner_budget(slice_s):.0f}",
           "--out", os.path.join(ctx.logs, "selftest"), "--no-progress"]
    done = {"resnet50"} if ctx.seed_table_ok else set()
    done |= {"lm"} if ctx.lm_ok else set()
    if done:
        cmd += ["--sections", ",".join(s for s in SELFTEST_SECTIONS if s not in done)]
    return cmd


def _lm_cmd(ctx: Ctx, slice_s: float) -> list[str]:
    return [ctx.python, "-m", "paratrain", "selftest", "--sections", "lm", "--budget",
            f"{inner_budget(slice_s):.0f}", "--out", os.path.join(ctx.logs, "lm"), "--no-progress"]


def _read_lm(ctx: Ctx, code: int | None, log: str) -> tuple[str, str, dict[str, Any]]:
    """The LM rows (``selftest --sections lm``): each loop's tokens/s against the plain loop's, per precision."""
    status, summary, details = _read_selftest(ctx, code, log, "lm")
    try:
        with open(os.path.join(ctx.logs, "lm", "selftest.json")) as f:
            rows = [r for r in json.load(f).get("rows", []) if isinstance(r, dict) and r.get("section") == "lm"]
    except (OSError, ValueError):
        rows = []
    ran = [r for r in rows if r.get("status") in ("ok", "FAIL") and isinstance(r.get("data"), dict)
           and "tokens_per_s" in r["data"]]
    details["lm"] = [{"check": r.get("check"), "status": r.get("status"), **r["data"]} for r in ran]
    failed = [r for r in rows if r.get("status") == "FAIL"]
    parts = []
    for r in ran:
        d = r["data"]
        mfu = f", MFU {d['mfu']:.0%}" if isinstance(d.get("mfu"), (int, float)) else ""
        ratio = f" = {d['ratio']:.3f}x plain" if isinstance(d.get("ratio"), (int, float)) else ""
        parts.append(f"{r.get('check')}: {d['tokens_per_s']:,.0f} tok/s{mfu}{ratio}")
    line = "; ".join(parts) if parts else "no LM rows ran"
    ctx.lm_ok = status == "ok" and bool(ran)
    if status == "ok" and failed:
        return "failed", f"{len(failed)} LM row(s) failed: {failed[0].get('check')}: {failed[0].get('result')}", details
    return status, line if status == "ok" else summary, details


def _seed_table_cmd(ctx: Ctx, slice_s: float) -> list[str]:
    return [ctx.python, "-m", "paratrain", "selftest", "--sections", "resnet50", "--budget",
            f"{inner_budget(slice_s):.0f}", "--out", os.path.join(ctx.logs, "seed_table"), "--no-progress"]


def _read_seed_table(ctx: Ctx, code: int | None, log: str) -> tuple[str, str, dict[str, Any]]:
    status, summary, details = _read_selftest(ctx, code, log, "seed_table")
    seed = details.get("seed_table") or []
    ctx.seed_table_ok = status == "ok" and any(c.get("status") == "ok" for c in seed)
    return status, details["seed_line"] if status == "ok" else summary, details


PACKAGE_HINT = re.compile(r"pip install|No module|not installed|is missing|package missing", re.I)
"""A skip reason that names a missing package (the other skips: budget, hardware, unsupported)."""


def _read_selftest(ctx: Ctx, code: int | None, log: str, sub: str = "selftest") -> tuple[str, str, dict[str, Any]]:
    sdir = os.path.join(ctx.logs, sub)
    details: dict[str, Any] = {}
    for ext in ("md", "json"):  # next to device_check.md, where notes quote them from
        src, dst = os.path.join(sdir, f"selftest.{ext}"), os.path.join(ctx.out, f"{sub}.{ext}")
        if os.path.exists(src):
            shutil.copyfile(src, dst)
            details[f"{sub}.{ext}"] = dst
    data: dict[str, Any] = {}
    try:
        with open(os.path.join(sdir, "selftest.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        pass
    rows = [r for r in data.get("rows", []) if isinstance(r, dict)]
    counts: dict[str, int] = {}
    for r in rows:
        counts[str(r.get("status"))] = counts.get(str(r.get("status")), 0) + 1
    skipped = [r for r in rows if str(r.get("status")).startswith("skip")]
    details["rows"] = counts
    details["skipped_for_budget"] = sum(1 for r in skipped if str(r.get("result", "")).startswith("budget"))
    details["skipped_rows"] = [f"{r.get('section')}: {r.get('check')}: {r.get('result')}" for r in skipped
                               if PACKAGE_HINT.search(str(r.get("result", "")))]
    details["failed_rows"] = [f"{r.get('section')}: {r.get('check')}: {r.get('result')}" for r in rows
                              if r.get("status") == "failed"]
    seed = [c for c in data.get("seed_table", []) if isinstance(c, dict)]
    seed_ok = [c for c in seed if c.get("status") == "ok"]
    details["seed_table"] = [{k: c.get(k) for k in ("label", "status", "seconds_per_epoch", "samples_per_s",
                                                     "seed_seconds", "skip")} for c in seed]
    if seed:
        times = ", ".join(f"{c.get('label')} {c.get('seconds_per_epoch'):.1f} s/epoch" for c in seed_ok
                          if isinstance(c.get("seconds_per_epoch"), (int, float)))
        seed_line = f"seed table (ResNet-50): {len(seed_ok)} of {len(seed)} rows ran" + (f" ({times})" if times else "")
    elif ctx.seed_table_ok and sub == "selftest":
        seed_line = "seed table: the seed_table step's"
    else:
        seed_line = "no seed table in selftest.json"
    details["seed_line"] = seed_line
    if code is None:
        return "failed", seed_line, details
    if code != 0:
        if details["failed_rows"]:
            return "failed", f"{len(details['failed_rows'])} row(s) failed: {details['failed_rows'][0]}", details
        reason = tail_line(log, r"invalid choice|No module|Error|error|FAIL|fail")
        if "invalid choice" in reason and "selftest" in reason:
            reason = f"this paratrain has no selftest command ({reason})"
        return "failed", reason or f"exit {code}", details
    own = str(data.get("summary") or ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
              or "no rows in selftest.json")
    return "ok", f"{own} ({details['skipped_for_budget']} skipped for the budget); {seed_line}", details


def _bench_cmd(ctx: Ctx, slice_s: float) -> list[str]:
    cmd = [ctx.python, "-m", "paratrain", "bench", "--quick", "--out", os.path.join(ctx.logs, "bench"), "--no-progress",
           "--cell-timeout", f"{max(20.0, min(120.0, slice_s / 3)):.0f}"]
    if ctx.dry:  # kept short: fp32, no hooks, one epoch
        cmd += ["--precisions", "32", "--comm-hooks", "none", "--no-trap", "--epochs", "1"]
    return cmd


def _read_bench(ctx: Ctx, code: int | None, log: str) -> tuple[str, str, dict[str, Any]]:
    try:
        with open(os.path.join(ctx.logs, "bench", "results.json")) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = None
    if code != 0 or res is None:
        return "failed", why_not(code, log), {}
    cells = res.get("cells", [])
    counts: dict[str, int] = {}
    for c in cells:
        counts[c.get("status", "?")] = counts.get(c.get("status", "?"), 0) + 1
    failed = [f"{c.get('label')}: {c.get('reason')}" for c in cells if c.get("status") == "failed"]
    rec = res.get("recommendation")
    rec = rec.get("label") if isinstance(rec, dict) else rec
    details = {"cells": counts, "failed_cells": failed, "recommendation": rec,
               "skipped_cells": [f"{c.get('label')}: {c.get('reason')}" for c in cells if c.get("status") == "skipped"],
               "gpu": (res.get("meta") or {}).get("machine", {}).get("gpu")}
    line = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f"; recommendation {rec}"
    if failed:
        return "failed", f"{len(failed)} cell(s) failed: {failed[0]}", details
    return "ok", line, details


def _dataloader_cmd(ctx: Ctx, slice_s: float) -> list[str]:
    cmd = [ctx.python, os.path.join(ROOT, "benchmarks", "dataloader.py"), "--dtypes", "float32",
           "--compare", "per-sample"]  # the headline ratio only: all pairs outran 45 s on an H200 machine
    return cmd + (["--workers", "0", "--rounds", "1", "--samples", "1024"] if ctx.dry else ["--rounds", "3"])


def _read_dataloader(ctx: Ctx, code: int | None, log: str) -> tuple[str, str, dict[str, Any]]:
    if code != 0:
        return "failed", why_not(code, log), {}
    ratios: list[dict[str, Any]] = []
    notes: list[str] = []
    section = ""
    with open(log, errors="replace") as f:
        for ln in f:
            m = re.match(r"\s*(\w+) images, (\d+) worker", ln)
            if m:
                section = f"{m.group(1)}, {m.group(2)} workers"
            m = re.search(r"ratio paratrain / (.+?): median ([\d.]+)×(?: \(per round ([\d.]+)–([\d.]+)×\))?", ln)
            if m:
                ratios.append({"section": section, "against": m.group(1), "median": float(m.group(2))})
            if re.search(r"skip", ln, re.I):
                notes.append(ln.strip())
    if not ratios:
        return "failed", "no 'ratio paratrain / ...' line in its output", {}
    main = [r for r in ratios if r["against"] == "per-sample DataLoader"] or ratios
    line = "; ".join(f"{r['section']}: {r['median']:.1f}x" for r in main) + " (paratrain / per-sample DataLoader)"
    return "ok", line, {"ratios": ratios, "notes": notes}


def _predict_cmd(ctx: Ctx, slice_s: float) -> list[str]:
    # not GPU-only: on a GPU machine it is the full check (4 and 8 workers), on --dry-run its 2-worker twin
    return _check_cmd(ctx, "predict", slice_s)


MakeCommand = Callable[[Ctx, float], list[str]]
"""The step's command for a slice of so many seconds."""
ReadResult = Callable[[Ctx, "int | None", str], tuple[str, str, dict]]
"""``(status, summary, details)`` from the exit status (None: killed at the slice's end) and the log."""
COMMANDS: dict[str, tuple[MakeCommand, ReadResult]] = {
    "lm": (_lm_cmd, _read_lm),
    "selftest": (_selftest_cmd, _read_selftest),
    "seed_table": (_seed_table_cmd, _read_seed_table),
    "bench_quick": (_bench_cmd, _read_bench),
    "dataloader": (_dataloader_cmd, _read_dataloader),
    "predict": (_predict_cmd, lambda ctx, code, log: _read_check(ctx, "predict", code, log)),
}


def command_for(step: Step) -> tuple[MakeCommand, ReadResult]:
    if step.name in COMMANDS:
        return COMMANDS[step.name]
    return ((lambda ctx, s: _check_cmd(ctx, step.name, s)),
            (lambda ctx, code, log: _read_check(ctx, step.name, code, log)))


def probe(runner: Runner, python: str, env: dict[str, str], out: str,
          timeout: float) -> tuple[dict[str, Any] | None, str]:
    """What the interpreter has: torch, CUDA, GPUs, the optional packages (``OUT/logs/probe.log``)."""
    path = os.path.join(out, "logs", "probe.log")
    packages = sorted({*OPTIONAL, "numpy", "tqdm", "safetensors", "transformers", "pytest"})
    code, _ = runner.run([python, "-c", PROBE % (packages,)], path, timeout, env, out)
    with open(path, errors="replace") as f:
        for ln in f:
            if ln.startswith("PROBE "):
                return json.loads(ln[6:]), ""
    return None, ("timed out" if code is None else tail_line(path, r"Error|error") or f"exit {code}")


def pre_skip(step: Step, ctx: Ctx, only: set[str] | None) -> str | None:
    """Why ``step`` cannot run here at all (before any budget), or None."""
    if only is not None and step.name not in only:
        return "not in --only"
    if ctx.dry and step.no_twin:
        return f"no CPU twin: {step.no_twin}"
    if step.gpu_only and not ctx.dry and not ctx.probe.get("cuda"):
        return f"no CUDA: torch {ctx.probe.get('torch')} sees no GPU (--dry-run runs its CPU twin)"
    if step.name == "compile" and not ctx.dry and not ctx.probe["packages"].get("triton"):
        return "package missing: triton (inductor on CUDA needs it)"
    gpus = len(ctx.probe.get("gpus") or [])
    if not ctx.dry and gpus < step.min_gpus:
        return f"needs {step.min_gpus} GPUs, {gpus} visible"
    missing = [p for p in step.packages if not ctx.probe["packages"].get(p)]
    if missing:
        return f"package missing: {', '.join(missing)}"
    return None
