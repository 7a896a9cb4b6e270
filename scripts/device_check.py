"""Check a GPU machine in one budget: ``paratrain selftest`` plus the checks only a GPU can settle.

    bash scripts/device_check.sh [--budget SECONDS] [--out DIR] [--dry-run] [--python PY] [--only A,B]

Steps, in this order (each in a process group of its own, killed at the end of its slice):

* ``nccl``: nccl at world size 1: collectives, paratrain's ``all_gather``/``reduce``, DDP = plain loop;
* ``fsdp_bf16``: ``paratrain train --strategy fsdp --precision bf16-mixed`` = ``--strategy single``;
* ``fp16_scaler``: a ``Parallel`` loop in fp16-mixed drives torch.amp's CUDA ``GradScaler``, follows
  fp32 and skips an inf step;
* ``syncbn``: ``sync_batchnorm=True`` makes ``nn.SyncBatchNorm``; ddp x2 = BatchNorm over the batch;
* ``compile``: ``Parallel(compile=True)`` (inductor) = eager;
* ``bench_quick``: ``paratrain bench --quick``;
* ``dataloader``: ``benchmarks/dataloader.py``, float32: paratrain's loader / a per-sample DataLoader;
* ``predict``: the ``bench --predict`` model against ddp measured at 4 and 8 workers over loopback gloo;
* ``seed_table``: ``paratrain selftest --sections resnet50``: the seed's table on ResNet-50; its
  report is copied into OUT as ``seed_table.md``/``.json``;
* ``selftest``: ``paratrain selftest --budget ...`` with the time left (without its resnet50 section
  when ``seed_table`` ran it); its ``selftest.md``/``.json`` are copied into OUT.

The first five need CUDA (without it they are skipped, with the reason); the checks themselves are
in ``scripts/device_checks``. Everything goes under ``--out`` (default ``$OUT`` when set, else
``runs/device_check``): at the top ``device_check.json`` and ``device_check.md`` (each step ok /
failed with its one-line reason / skipped with why: no CUDA, a package missing, the budget; the
optional rows skipped for a missing package), ``selftest.md``/``.json`` and ``seed_table.md``/``.json``
(six files: a machine that hands back only a few files hands back these first); below ``logs/``,
``<step>.log`` per step and what the steps wrote. Exit status 1 when a step failed
(or the run was interrupted), else 0.

The steps share ``--budget`` (default 420 s: the whole run ends within 8 minutes). Each step gets
a slice (:func:`plan_slice`): at most what it wants, and never what the steps after it need;
``selftest``, last, takes what the others leave. Time a step does not use goes to the steps after
it. A step whose slice would fall below its need is skipped, listed as such.

``--dry-run`` runs the same orchestration on a machine without a GPU (1 to 2.5 minutes on 2 cores):
each GPU-only check as its CPU twin at tiny size (gloo, CPU autocast, paratrain's own
SyncBatchNorm, torch.compile with the ``aot_eager`` backend, which needs no C++ compiler), selftest
with a small budget, and the benchmarks at small sizes.

This driver imports nothing but the standard library: ``--python`` (default: this interpreter)
runs every step, with ``PYTHONPATH`` set to the checkout; nothing is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BUDGET = 420.0
DEFAULT_DRY_BUDGET = 150.0
KILL_GRACE = 5.0
"""Seconds between SIGTERM and SIGKILL of a step's process group past its slice."""


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    want: float | None
    """Seconds it is given when the budget holds every step; None: what the others leave."""
    need: float
    """Below this it is skipped."""
    dry_want: float | None
    dry_need: float
    gpu_only: bool = False
    packages: tuple[str, ...] = ()
    """Needed to run at all (a missing one skips the step)."""

    def want_for(self, dry: bool) -> float | None:
        return self.dry_want if dry else self.want

    def need_for(self, dry: bool) -> float:
        return self.dry_need if dry else self.need


STEPS: tuple[Step, ...] = (
    Step("nccl", "nccl at world size 1: collectives, all_gather/reduce, DDP = plain loop", 45, 20, 30, 10, True),
    Step("fsdp_bf16", "fsdp + bf16-mixed = single + bf16-mixed, and with cpu_offload (paratrain train)",
         90, 30, 60, 15, True),
    Step("fp16_scaler", "fp16-mixed with torch.amp's CUDA GradScaler: follows fp32, skips an inf step",
         40, 15, 30, 10, True),
    Step("syncbn", "nn.SyncBatchNorm (sync_batchnorm=True), ddp x2 = BatchNorm over the whole batch",
         60, 25, 60, 15, True),
    Step("compile", "torch.compile (Parallel(compile=True), inductor) = eager", 100, 45, 45, 10, True),
    Step("bench_quick", "paratrain bench --quick", 75, 30, 60, 15),
    Step("dataloader", "batched loader / per-sample DataLoader, float32 (benchmarks/dataloader.py)", 45, 15, 30, 10),
    Step("predict", "bench --predict's model vs ddp measured at 4 and 8 workers, loopback gloo", 75, 30, 60, 15),
    Step("seed_table", "the seed's table on ResNet-50 (paratrain selftest --sections resnet50)", 130, 50, 30, 15),
    Step("selftest", "paratrain selftest (its other sections, with the time left)", None, 90, 40, 20),
)
"""Wants and needs (seconds) as measured or expected on one H100 with 16 cores (the dry run's on 2
CPU cores): the fixed steps' wants are generous caps; selftest, last, fills what they leave."""

SELFTEST_SECTIONS = ("correctness", "collectives", "speed", "memory", "resnet50", "compile")
"""paratrain.selftest.run.SECTIONS (this driver imports nothing from paratrain; a test keeps them equal)."""

OPTIONAL = {
    "matplotlib": "bench_quick's chart.png and predict.png",
    "torchvision": "dataloader's per-sample torchvision transforms vs BatchAugment; torchvision:<name> models",
    "triton": "compile (inductor on CUDA needs triton)",
    "accelerate": "selftest's speed row for Accelerate",
    "lightning": "selftest's speed row for Lightning",
}
"""Packages whose absence skips a row, and which rows."""

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


def plan_slice(remaining: float, want: float | None, need: float,
               later: list[tuple[float | None, float]]) -> float | None:
    """Seconds for a step, given the ``remaining`` budget and the ``(want, need)`` of the steps still
    to run after it; None: skip it (its need would leave the later steps less than theirs).

    A step with a ``want`` gets at most that; one without (selftest) gets what the later steps'
    wants leave, at least its need. No step takes what the later steps need."""
    hi = remaining - sum(n for _, n in later)
    if hi < need:
        return None
    if want is not None:
        return min(want, hi)
    return max(need, min(hi, remaining - sum(n if w is None else max(w, n) for w, n in later)))


def inner_budget(slice_s: float) -> float:
    """What a step that keeps its own budget (selftest) is told: its slice less the time to start
    and to write its report (15%, 10-30 s)."""
    return max(slice_s / 2, slice_s - min(30.0, max(10.0, 0.15 * slice_s)))


@dataclass
class Outcome:
    name: str
    what: str
    status: str  # ok, failed, skipped
    summary: str = ""
    """ok: the result; failed: the one-line reason; skipped: why."""
    seconds: float = 0.0
    slice_s: float | None = None
    command: list[str] = field(default_factory=list)
    log: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- running a step


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Runner:
    """Starts a step's command in a new session (process group), output to its log, and kills the
    whole group at the deadline or when the driver is told to stop."""

    def __init__(self) -> None:
        self.current: subprocess.Popen | None = None
        self.stopping: str | None = None

    def kill(self, proc: subprocess.Popen) -> None:
        for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                proc.wait(wait)
                # the leader is gone; what it started may still be in the group
                os.killpg(proc.pid, signal.SIGKILL)
                return
            except subprocess.TimeoutExpired:
                continue
            except (ProcessLookupError, PermissionError):
                return

    def run(self, cmd: list[str], log_path: str, timeout: float, env: dict[str, str],
            cwd: str) -> tuple[int | None, float]:
        """Exit status (None: killed at the deadline) and seconds."""
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            log.write(f"$ {shlex.join(cmd)}\n# cwd {cwd}; limit {timeout:.0f} s\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent)
            self.current = proc
            try:
                proc.wait(timeout=max(0.1, timeout))
                code: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
            finally:
                self.kill(proc)  # past the deadline; or stragglers of a step that ended
                self.current = None
            seconds = time.monotonic() - t0
            log.write(f"\n# {'killed at its limit' if code is None else f'exit {code}'} after {seconds:.1f} s\n")
        return code, seconds

    def stop(self, why: str) -> None:
        self.stopping = why
        if self.current is not None:
            self.kill(self.current)


def _tail_line(path: str, pattern: str | None = None) -> str:
    """The last non-empty line of a log (the last one matching ``pattern`` when given), or ''."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("# ")]
    except OSError:
        return ""
    if pattern:
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else ""


def _why_not(code: int | None, log: str) -> str:
    """A failed command's one-line reason: its last error line, or its exit status."""
    return "killed at its slice" if code is None else _tail_line(log, r"Error|error") or f"exit {code}"


# --------------------------------------------------------------------------- the steps' commands and readers


@dataclass
class Ctx:
    python: str
    out: str
    dry: bool
    probe: dict[str, Any]
    seed_table_ok: bool = False
    """The seed_table step ran its rows: selftest then skips its own resnet50 section."""

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
        return "failed", f"exit {code}, no result: {_tail_line(log, r'Error|error|failed')}", {}
    return res["status"], res.get("summary") or res.get("reason") or "", res.get("details", {})


def _selftest_cmd(ctx: Ctx, slice_s: float) -> list[str]:
    cmd = [ctx.python, "-m", "paratrain", "selftest", "--budget", f"{inner_budget(slice_s):.0f}",
           "--out", os.path.join(ctx.logs, "selftest"), "--no-progress"]
    if ctx.seed_table_ok:
        cmd += ["--sections", ",".join(s for s in SELFTEST_SECTIONS if s != "resnet50")]
    return cmd


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
        reason = _tail_line(log, r"invalid choice|No module|Error|error|FAIL|fail")
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
        return "failed", _why_not(code, log), {}
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
        return "failed", _why_not(code, log), {}
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
    "selftest": (_selftest_cmd, _read_selftest),
    "seed_table": (_seed_table_cmd, _read_seed_table),
    "bench_quick": (_bench_cmd, _read_bench),
    "dataloader": (_dataloader_cmd, _read_dataloader),
    "predict": (_predict_cmd, lambda ctx, code, log: _read_check(ctx, "predict", code, log)),
}


def _command(step: Step) -> tuple[MakeCommand, ReadResult]:
    if step.name in COMMANDS:
        return COMMANDS[step.name]
    return ((lambda ctx, s: _check_cmd(ctx, step.name, s)),
            (lambda ctx, code, log: _read_check(ctx, step.name, code, log)))


# --------------------------------------------------------------------------- the run


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
    return None, ("timed out" if code is None else _tail_line(path, r"Error|error") or f"exit {code}")


def pre_skip(step: Step, ctx: Ctx, only: set[str] | None) -> str | None:
    """Why ``step`` cannot run here at all (before any budget), or None."""
    if only is not None and step.name not in only:
        return "not in --only"
    if step.gpu_only and not ctx.dry and not ctx.probe.get("cuda"):
        return f"no CUDA: torch {ctx.probe.get('torch')} sees no GPU (--dry-run runs its CPU twin)"
    if step.name == "compile" and not ctx.dry and not ctx.probe["packages"].get("triton"):
        return "package missing: triton (inductor on CUDA needs it)"
    missing = [p for p in step.packages if not ctx.probe["packages"].get(p)]
    if missing:
        return f"package missing: {', '.join(missing)}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="steps: " + ", ".join(s.name for s in STEPS))
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for everything (default {DEFAULT_BUDGET:.0f}; --dry-run {DEFAULT_DRY_BUDGET:.0f})")
    ap.add_argument("--out", default=None, help="where logs and the summary go (default: $OUT, else runs/device_check)")
    ap.add_argument("--dry-run", action="store_true", help="the CPU twins at tiny size: test the orchestration here")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs every step (default: this one)")
    ap.add_argument("--only", default=None, help="comma-separated steps to run (the others are listed as skipped)")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    budget = args.budget if args.budget is not None else (DEFAULT_DRY_BUDGET if args.dry_run else DEFAULT_BUDGET)
    out = os.path.abspath(args.out or os.environ.get("OUT") or os.path.join(ROOT, "runs", "device_check"))
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    only = None if args.only is None else {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = sorted((only or set()) - {s.name for s in STEPS})
    if unknown:
        ap.error(f"--only: unknown step(s) {', '.join(unknown)}: use {', '.join(s.name for s in STEPS)}")
    python = shutil.which(args.python) or args.python
    python = os.path.abspath(python) if os.sep in python else python
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if args.dry_run:
        env.setdefault("OMP_NUM_THREADS", "1")
    runner = Runner()

    def on_signal(signum: int, _frame: Any) -> None:
        if runner.stopping:  # a second signal: the first is being handled
            return
        runner.stop(f"stopped by {signal.Signals(signum).name}")
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    print(f"device_check: budget {budget:.0f} s{' (dry run: CPU twins)' if args.dry_run else ''}; "
          f"python {python}; out {out}", flush=True)
    outcomes: list[Outcome] = []
    try:
        info, why = probe(runner, python, env, out, 90.0)  # importing torch: seconds, a minute on a cold disk
    except KeyboardInterrupt:
        info, why = None, str(runner.stopping)
    if info is None:
        outcomes = [Outcome(s.name, s.what, "skipped", f"the interpreter could not import torch and paratrain: {why}")
                    for s in STEPS]
        return finish(out, budget, args, {"python": python, "error": why}, outcomes, t_start, failed_probe=why)
    gpus = f", GPUs {', '.join(info['gpus'])}" if info["gpus"] else ""
    print(f"torch {info['torch']} (CUDA build {info['cuda_build']}), CUDA available: {info['cuda']}{gpus}; "
          f"{info['cores']} cores; python {info['python']}", flush=True)
    ctx = Ctx(python, out, args.dry_run, info)
    pending = [(s, pre_skip(s, ctx, only)) for s in STEPS]
    try:
        for i, (step, skip) in enumerate(pending):
            if skip is not None:
                outcomes.append(Outcome(step.name, step.what, "skipped", skip))
                continue
            if runner.stopping:
                outcomes.append(Outcome(step.name, step.what, "skipped", runner.stopping))
                continue
            remaining = budget - (time.monotonic() - t_start)
            later = [(s.want_for(args.dry_run), s.need_for(args.dry_run)) for s, k in pending[i + 1:] if k is None]
            slice_s = plan_slice(remaining, step.want_for(args.dry_run), step.need_for(args.dry_run), later)
            if slice_s is None:
                why = (f"budget: {max(0.0, remaining):.0f} s left, it needs {step.need_for(args.dry_run):.0f} s "
                       f"and the steps after it {sum(n for _, n in later):.0f} s")
                outcomes.append(Outcome(step.name, step.what, "skipped", why))
                print(f"[{step.name}] skipped: {outcomes[-1].summary}", flush=True)
                continue
            make, read = _command(step)
            cmd = make(ctx, slice_s)
            log = os.path.join(ctx.logs, f"{step.name}.log")
            print(f"[{step.name}] {step.what} (slice {slice_s:.0f} s of {remaining:.0f} s left)", flush=True)
            code, seconds = runner.run(cmd, log, slice_s, env, out)
            if runner.stopping:
                outcomes.append(Outcome(step.name, step.what, "failed", runner.stopping, seconds, slice_s, cmd, log))
                continue
            status, summary, details = read(ctx, code, log)
            if code is None and status != "failed":
                status, summary = "failed", f"killed at the end of its {slice_s:.0f} s slice"
            elif code is None:
                summary = f"killed at the end of its {slice_s:.0f} s slice" + (f" ({summary})" if summary else "")
            outcomes.append(Outcome(step.name, step.what, status, summary, seconds, slice_s, cmd, log, details))
            print(f"[{step.name}] {status} in {seconds:.0f} s: {summary}", flush=True)
    except KeyboardInterrupt:
        done = {o.name for o in outcomes}
        outcomes += [Outcome(s.name, s.what, "skipped", runner.stopping or "interrupted") for s, _ in pending
                     if s.name not in done]
    return finish(out, budget, args, info, outcomes, t_start, interrupted=runner.stopping)


def finish(out: str, budget: float, args: argparse.Namespace, info: dict[str, Any], outcomes: list[Outcome],
           t_start: float, failed_probe: str | None = None, interrupted: str | None = None) -> int:
    total = time.monotonic() - t_start
    inductor = info.get("cuda") and not args.dry_run  # triton matters only to inductor on CUDA
    missing = sorted(p for p, ok in (info.get("packages") or {}).items()
                     if not ok and p in OPTIONAL and (p != "triton" or inductor))
    optional_skips = [f"{o.name}: {o.summary}" for o in outcomes if o.summary.startswith("package missing")]
    for o in outcomes:
        optional_skips += [f"{o.name}: {r}" for r in o.details.get("skipped_rows", [])]
        optional_skips += [f"{o.name}: {n}" for n in o.details.get("notes", []) if PACKAGE_HINT.search(n)]
    optional_skips = list(dict.fromkeys(optional_skips))  # the same row skipped in several sections: once
    failed = [o for o in outcomes if o.status == "failed"]
    failed += [Outcome(what, "", "failed", why) for what, why in (("probe", failed_probe), ("run", interrupted)) if why]
    summary = {
        "ok": not failed, "interrupted": interrupted, "dry_run": args.dry_run, "budget_s": budget,
        "seconds": round(total, 1), "out": out, "machine": info, "packages_missing": {p: OPTIONAL[p] for p in missing},
        "optional_skipped": optional_skips,
        "steps": [{**asdict(o), "seconds": round(o.seconds, 1),
                   "slice_s": None if o.slice_s is None else round(o.slice_s, 1)} for o in outcomes],
    }
    with open(os.path.join(out, "device_check.json.tmp"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    os.replace(os.path.join(out, "device_check.json.tmp"), os.path.join(out, "device_check.json"))
    md = render_md(summary)
    with open(os.path.join(out, "device_check.md"), "w") as f:
        f.write(md)
    print("\n" + md, flush=True)
    return 1 if failed else 0


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_md(s: dict[str, Any]) -> str:
    m = s["machine"]
    gpus = ", ".join(m.get("gpus") or []) or "none"
    lines = [
        f"# device check{' (dry run: CPU twins at tiny size)' if s['dry_run'] else ''}: "
        f"{'PASS' if s['ok'] else 'FAIL'}",
        "",
        f"torch {m.get('torch', '?')} (CUDA build {m.get('cuda_build')}), GPUs: {gpus}"
        + (f", NCCL {m['nccl']}" if m.get("nccl") else "")
        + f"; {m.get('cores', '?')} cores; python {m.get('python', '?')} ({m.get('executable', m.get('python'))}); "
        f"paratrain {m.get('paratrain', '?')} from {m.get('paratrain_from', '?')}",
        f"{s['seconds']:.0f} s of a {s['budget_s']:.0f} s budget"
        + (f"; {s['interrupted']}: the steps not run are listed as skipped." if s["interrupted"] else "."),
        "",
        "| step | what | status | s / slice | result, reason |",
        "|---|---|---|---|---|",
    ]
    for o in s["steps"]:
        took = f"{o['seconds']:.0f} / {o['slice_s']:.0f}" if o["slice_s"] is not None else "-"
        lines.append(f"| {o['name']} | {_cell(o['what'])} | {o['status']} | {took} | {_cell(o['summary'])} |")
    if s["packages_missing"]:
        lines += ["", "Packages missing here (nothing is installed), and what they would have run:", ""]
        lines += [f"- {p}: {_cell(what)}" for p, what in s["packages_missing"].items()]
    if s["optional_skipped"]:
        lines += ["", "Rows skipped for a missing package:", ""] + [f"- {_cell(x)}" for x in s["optional_skipped"]]
    recorded = [o for o in s["steps"] if o["name"] in ("dataloader", "predict") and o["status"] == "ok"]
    if recorded:
        lines += ["", "Recorded (issue 29, item 4):", ""]
        for o in recorded:
            lines.append(f"- {o['name']}: {_cell(o['summary'])}")
    sm = next((o for o in s["steps"] if o["name"] == "selftest"), None)
    if sm and sm["details"].get("selftest.md"):
        lines += ["", f"selftest's own report: `{sm['details']['selftest.md']}`"]
    lines += ["", "Logs: `<step>.log` in " + f"`{os.path.join(s['out'], 'logs')}`."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
