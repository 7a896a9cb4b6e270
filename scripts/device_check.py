"""Check a GPU machine in one budget: ``paratrain selftest`` plus the checks only a GPU can settle.

    bash scripts/device_check.sh [--budget SECONDS] [--out DIR] [--dry-run] [--python PY] [--only A,B]

Steps, in this order (each in a process group of its own, killed at the end of its slice):

* ``nccl``: nccl at world size 1: collectives, paratrain's ``all_gather``/``reduce``, DDP = plain loop; a
  one-rank collective past its timeout dumps Flight Recorder's ring, which ``paratrain doctor`` reads back;
* ``lm``: ``paratrain selftest --sections lm``: a GPT-2 124M-shaped model, the plain loop of nanoGPT's
  ``train.py`` against ``Parallel`` single, ddp x1, fsdp x1, Accelerate and Fabric, interleaved:
  tokens/s, MFU and peak memory, bf16-mixed and fp16-mixed; its report is copied into OUT as
  ``lm.md``/``.json``;
* ``hangs``: on 2+ GPUs, ``tests/trace/test_hangs.py`` under nccl (ranks out of step, one line each);
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
* ``selftest``: ``paratrain selftest --budget ...`` with the time left (without its resnet50 and lm
  sections when ``seed_table`` and ``lm`` ran them); its ``selftest.md``/``.json`` are copied into OUT.

The GPU-only checks need CUDA (without it they are skipped, with the reason); the checks themselves are
in ``scripts/device_checks``. Everything goes under ``--out`` (default ``$OUT`` when set, else
``runs/device_check``): at the top ``device_check.json`` and ``device_check.md`` (each step ok /
failed with its one-line reason / skipped with why: no CUDA, a package missing, the budget; the
optional rows skipped for a missing package), ``selftest.md``/``.json`` and ``seed_table.md``/``.json``
(six files: a machine that hands back only a few files hands back these first); below ``logs/``,
``<step>.log`` per step and what the steps wrote. Exit status 1 when a step failed
(or the run was interrupted), else 0.

The steps share ``--budget`` (default 540 s: the whole run ends within 10 minutes). Each step gets
a slice (:func:`plan_slice`): at most what it wants, and never what the steps after it need;
``selftest``, last, takes what the others leave. Time a step does not use goes to the steps after
it. A step whose slice would fall below its need is skipped, listed as such.

``--dry-run`` runs the same orchestration on a machine without a GPU (1 to 2.5 minutes on 2 cores):
each GPU-only check as its CPU twin at tiny size (gloo, CPU autocast, paratrain's own
SyncBatchNorm, torch.compile with the ``aot_eager`` backend, which needs no C++ compiler), selftest
with a small budget, and the benchmarks at small sizes. Its wants and needs are a quiet 2-core machine's; a
``--budget`` above its default (180 s) is read as a slower or busier machine's, and a step is killed only past its
slice times that ratio (what it does within the slice is its own budget, as planned).

This driver imports nothing but the standard library: ``--python`` (default: this interpreter)
runs every step, with ``PYTHONPATH`` set to the checkout; nothing is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # device_driver, beside this file

from device_driver.plan import (DEFAULT_BUDGET, DEFAULT_DRY_BUDGET, OPTIONAL, SELFTEST_SECTIONS,  # noqa: E402,F401
                                STEPS, inner_budget, kill_room, plan_slice)
from device_driver.report import finish  # noqa: E402
from device_driver.runner import Outcome, Runner  # noqa: E402
from device_driver.steps import ROOT, Ctx, command_for, pre_skip, probe  # noqa: E402


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
    room = kill_room(budget, args.dry_run)  # a step is killed past its slice times this
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
            make, read = command_for(step)
            cmd = make(ctx, slice_s)
            log = os.path.join(ctx.logs, f"{step.name}.log")
            print(f"[{step.name}] {step.what} (slice {slice_s:.0f} s of {remaining:.0f} s left)", flush=True)
            code, seconds = runner.run(cmd, log, slice_s * room, env, out)
            if runner.stopping:
                outcomes.append(Outcome(step.name, step.what, "failed", runner.stopping, seconds, slice_s, cmd, log))
                continue
            status, summary, details = read(ctx, code, log)
            if code is None and status != "failed":
                status, summary = "failed", f"killed at the end of its {slice_s * room:.0f} s slice"
            elif code is None:
                summary = f"killed at the end of its {slice_s * room:.0f} s slice" + (f" ({summary})" if summary else "")
            outcomes.append(Outcome(step.name, step.what, status, summary, seconds, slice_s, cmd, log, details))
            print(f"[{step.name}] {status} in {seconds:.0f} s: {summary}", flush=True)
    except KeyboardInterrupt:
        done = {o.name for o in outcomes}
        outcomes += [Outcome(s.name, s.what, "skipped", runner.stopping or "interrupted") for s, _ in pending
                     if s.name not in done]
    return finish(out, budget, args, info, outcomes, t_start, interrupted=runner.stopping)


if __name__ == "__main__":
    sys.exit(main())
