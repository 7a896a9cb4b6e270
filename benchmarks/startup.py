"""Time to first step: paratrain against hand-written scripts, as whole processes.

What it measures
    Wall time from process start to process exit of a job that takes one optimizer step on the
    digits/MLP task and reports the test accuracy:

    (a) ``python benchmarks/handwritten/digits_single.py`` against
        ``paratrain train --max-steps 1`` (one process);
    (b) ``torchrun --nproc-per-node 2 benchmarks/handwritten/digits_ddp.py`` against
        ``paratrain train --strategy ddp --nproc-per-node 2 --max-steps 1``.

    The hand-written scripts do what a user's script does: import torch and scikit-learn, load the
    digits, build the model (and DDP), one step, evaluate. paratrain's side also writes its logs and
    result.json. CPU time is printed too: the seconds the machine's cores were busy during the run
    (``/proc/stat``; run it on a quiet machine). A process tree's own accounting would miss
    paratrain's workers, which fork from a forkserver that the command does not wait for.

How
    ``--runs`` pairs, the two sides alternating (ABBA) so that drift and background load hit both
    alike, after ``--warmup`` untimed warm-up pairs (file cache). Each side runs with
    ``OMP_NUM_THREADS=1`` per worker. Every paratrain run writes to a fresh run folder (``--log-dir
    <temp>/runs/{name}``, as the default ``runs/{name}`` does; the temporary folder is removed at
    the end): ``paratrain train`` refuses a log folder that already holds a run. The ratio is
    median(paratrain) / median(hand-written); target ≤ 0.9.

Usage::

    python benchmarks/startup.py [--runs 5] [--warmup 1] [--only a|b]
    python benchmarks/startup.py --smoke   # one pair, no warm-up: checks that it runs (CI), numbers mean nothing
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


def _busy_seconds() -> float:
    """CPU seconds this machine has been busy (all processes), from /proc/stat; else this
    process's waited-for children (which misses paratrain's workers: their parent, the
    forkserver, is not waited for by the command)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq steal
    except (OSError, ValueError):
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds the machine was busy) of one run of ``cmd``; fails loudly."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    before = _busy_seconds()
    start = time.perf_counter()
    res = subprocess.run(cmd, cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    busy = _busy_seconds() - before
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return wall, busy


def pair(name: str, hand: list[str], ours: list[str], runs: int, warmup: int) -> None:
    for _ in range(warmup):  # file cache, .pyc
        timed(hand), timed(ours)
    results: dict[str, list[tuple[float, float]]] = {"hand-written": [], "paratrain": []}
    for i in range(runs):
        order = [("hand-written", hand), ("paratrain", ours)]
        for label, cmd in (order if i % 2 == 0 else order[::-1]):
            results[label].append(timed(cmd))
    print(f"\n({name})")
    print(f"  hand-written: {' '.join(hand[1:]) if hand[0] == sys.executable else ' '.join(hand)}")
    print(f"  paratrain:    paratrain {' '.join(ours[3:])}")
    print(f"  {'':14s} {'wall median':>12s} {'wall min':>10s} {'CPU median':>11s}")
    for label, rs in results.items():
        walls, cpus = [w for w, _ in rs], [c for _, c in rs]
        print(f"  {label:14s} {statistics.median(walls):11.2f}s {min(walls):9.2f}s {statistics.median(cpus):10.2f}s")
    med = {k: statistics.median(w for w, _ in v) for k, v in results.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in results.items()}
    per_pair = [p[0] / h[0] for p, h in zip(results["paratrain"], results["hand-written"])]
    print(f"  ratio paratrain / hand-written: wall {med['paratrain'] / med['hand-written']:.2f} "
          f"(per pair {min(per_pair):.2f}-{max(per_pair):.2f}), CPU {cpu['paratrain'] / cpu['hand-written']:.2f}"
          f"  (target <= 0.90)")


SMOKE = {"runs": 1, "warmup": 0}
"""``--smoke``: what CI runs (``tests/test_benchmarks.py``); flags given explicitly still win."""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed pairs first (default 1)")
    ap.add_argument("--only", choices=("a", "b"))
    ap.add_argument("--smoke", action="store_true",
                    help=f"check that the benchmark runs, quickly ({SMOKE}); the numbers mean nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    py = sys.executable
    out = tempfile.mkdtemp(prefix="paratrain-startup-")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, "
          f"load average {os.getloadavg()[0]:.1f}; python {platform.python_version()}; {args.runs} pairs, ABBA"
          f"{', smoke: the numbers mean nothing' if args.smoke else ''}")
    # A fresh run folder for every run, named as the default runs/{name} names it: paratrain train
    # refuses a --log-dir that already holds a run.
    common = ["--max-steps", "1", "--no-progress", "--log-dir", os.path.join(out, "runs", "{name}")]
    try:
        if args.only in (None, "a"):
            pair("a: one process", [py, str(HERE / "handwritten" / "digits_single.py")],
                 [py, "-m", "paratrain", "train", *common], args.runs, args.warmup)
        if args.only in (None, "b"):
            pair("b: DDP, 2 processes", [py, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                         str(HERE / "handwritten" / "digits_ddp.py")],
                 [py, "-m", "paratrain", "train", "--strategy", "ddp", "--nproc-per-node", "2", *common],
                 args.runs, args.warmup)
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
