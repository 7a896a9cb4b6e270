"""Step-time overhead of paratrain's ``ddp`` strategy against a hand-written PyTorch DDP loop.

What it measures
    The median wall-clock time of one training step (data loading + forward + loss + backward with
    the DDP gradient all-reduce + SGD step) for two variants that do exactly the same work:

    * ``plain``: seed 000's loop, written by hand: ``init_process_group("gloo")``, a
      ``DistributedSampler`` with ``set_epoch`` every epoch, a ``DataLoader``, ``DDP(model)``,
      ``SGD(lr=0.001, momentum=0.9)``, ``CrossEntropyLoss``.
    * ``paratrain``: the same loop through ``paratrain.Parallel(strategy="ddp", precision="32",
      global_batch=nprocs * batch)``: ``pt.setup``, ``pt.train_loader``, ``pt.backward``.

    Same model (``paratrain.models.build_model``, same seed, so same initial weights), same
    synthetic CIFAR-shaped data (``paratrain.data.datasets.synthetic``), same per-rank batch, same
    optimizer and loss. Neither loop calls ``.item()``, logs or prints inside the timed region.

How
    Both variants run in the same ``paratrain.launch`` of ``--nprocs`` processes (2 by default),
    each process pinned to one intra-op thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``)
    so two processes share two cores without oversubscription. They share one gloo process group
    (whichever variant is set up first creates it; the other joins it) and one dataset tensor, but
    each has its own model, DDP wrapper, sampler, DataLoader and optimizer. Each loop is a generator that yields
    right after ``optimizer.step()``, so one ``next()`` is exactly one step of the loop as written;
    it is timed with ``time.perf_counter()``, data loading included. After ``--warmup`` untimed
    steps of each (DDP's first-iteration setup, allocator warm-up), the variants alternate in
    blocks of ``--block`` steps in ABBA order until each has ``--steps`` timed steps, so that
    background load and drift hit both alike (``paratrain.bench.overhead``: the same generators
    and interleaving that ``paratrain bench``'s hand-written baseline cell uses). A step's time is the slowest rank's. ``--rounds``
    repeats this in fresh launches, alternating which variant is set up and run first. The ratio
    is median(paratrain) / median(plain) over all timed steps of all rounds; the per-round ratios
    are printed too, and the same ratio of per-step process CPU time (``time.process_time()``,
    gloo's threads included, mean over ranks), which other jobs on the machine disturb less than
    wall time. The load average is printed with the hardware line: on a busy machine, read the
    CPU-time ratio alongside the wall-time one.

Usage::

    python benchmarks/overhead.py [--steps 60] [--rounds 3] [--nprocs 2] [--model cnn] [--batch 64]
                                  [--json out.json]
    python benchmarks/overhead.py --smoke   # 2 steps per variant, batch 8, both orders: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import warnings
from typing import Iterator

# Run from a checkout without installing paratrain (the spawned workers re-import this file too).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import optim  # noqa: E402

import paratrain  # noqa: E402
from paratrain.bench.baseline import plain_ddp_steps  # noqa: E402
from paratrain.bench.overhead import VARIANTS, Overhead, interleave, parallel_steps  # noqa: E402
from paratrain.data.datasets import synthetic  # noqa: E402
from paratrain.env.process import destroy  # noqa: E402
from paratrain.models import build_model  # noqa: E402

# torch 2.13 warns once per DDP(...) that paratrain passes ``broadcast_buffers`` (deprecated name);
# it changes nothing measured here, so keep the output to the numbers.
warnings.filterwarnings("ignore", message=".*broadcast_buffers.*deprecated", category=FutureWarning)

INPUT_SHAPE = (3, 32, 32)
NUM_CLASSES = 10


def _dataset(cfg: dict):
    return synthetic(cfg["dataset_size"], INPUT_SHAPE, NUM_CLASSES, seed=cfg["seed"])


# --------------------------------------------------------------------------- plain (seed 000)
# Each variant is a generator: its setup runs on the first next(), then every next() is exactly one
# training step of the loop as written (the ``yield`` sits where the step ends), so the two loops
# can be timed step by step and interleaved in the same processes.

def plain_steps(cfg: dict, trainset) -> Iterator[None]:
    """Seed 000's hand-written DDP loop (``paratrain.bench.baseline``, which ``paratrain bench`` uses too)."""
    if not dist.is_initialized():
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend="gloo", init_method="env://", world_size=world_size, rank=rank)
        dist.barrier()
    device = torch.device("cpu")
    torch.manual_seed(cfg["seed"])
    net = build_model(cfg["model"], INPUT_SHAPE, NUM_CLASSES).to(device)
    for _ in plain_ddp_steps(net, trainset, cfg["batch"], lr=0.001, momentum=0.9, seed=cfg["seed"], device=device):
        yield  # the first one after setup, then one per training step


# --------------------------------------------------------------------------- paratrain

def paratrain_steps(cfg: dict, trainset) -> Iterator[None]:
    """The same loop through paratrain.Parallel (``paratrain.bench.overhead.parallel_steps``; joins
    the process group if one exists)."""
    world_size = int(os.environ["WORLD_SIZE"])
    pt = paratrain.Parallel(strategy="ddp", precision="32", global_batch=cfg["batch"] * world_size,
                            backend="gloo", accelerator="cpu", seed=cfg["seed"])
    torch.manual_seed(cfg["seed"])
    net = build_model(cfg["model"], INPUT_SHAPE, NUM_CLASSES)
    for _ in parallel_steps(pt, net, optim.SGD(net.parameters(), lr=0.001, momentum=0.9), trainset):
        yield


STEPS = {"plain": plain_steps, "paratrain": paratrain_steps}


def _worker(local_rank: int, first: str, cfg: dict) -> dict:
    torch.set_num_threads(cfg["threads"])
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set by an earlier parallel region
        pass
    trainset = _dataset(cfg)  # one copy, shared by both variants
    order = (first, *[v for v in VARIANTS if v != first])
    loops = {v: STEPS[v](cfg, trainset) for v in order}
    for v in order:
        next(loops[v])  # setup (untimed)
    timed = interleave(loops, cfg["steps"], cfg["block"], cfg["warmup"], first=first)  # ABBA at block level
    times = {v: [s for block in timed["wall"][v] for s in block] for v in VARIANTS}
    cpu = {v: [s for block in timed["cpu"][v] for s in block] for v in VARIANTS}
    for loop in loops.values():
        loop.close()
    del loops
    destroy(wait_for_peers=True)  # one group, used by both variants; barrier first (see paratrain.env.process)
    return {"rank": local_rank, "step_s": times, "cpu_s": cpu, "threads": torch.get_num_threads()}


# --------------------------------------------------------------------------- driver

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_round(first: str, cfg: dict, nprocs: int, timeout: float):
    """One launch running both variants interleaved, ``first`` first.

    Returns, per variant, each timed step's wall time in seconds (the slowest rank's) and its
    process CPU time (mean over ranks), and the workers' torch thread count.
    """
    results = paratrain.launch(_worker, nprocs, args=(first, cfg), timeout=timeout,
                               env={"OMP_NUM_THREADS": str(cfg["threads"])}, start_method="forkserver", preload=["paratrain"])
    results = sorted(results, key=lambda r: r["rank"])
    wall = {v: [max(step) for step in zip(*(r["step_s"][v] for r in results))] for v in VARIANTS}
    cpu = {v: [statistics.fmean(step) for step in zip(*(r["cpu_s"][v] for r in results))] for v in VARIANTS}
    return wall, cpu, results[0]["threads"]


SMOKE = {"steps": 2, "warmup": 1, "block": 1, "batch": 8, "rounds": 2}
"""``--smoke``: what CI runs (``tests/test_benchmarks.py``); two rounds, so that each variant is set up first
once (the one set up first creates the process group). Flags given explicitly still win."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="timed steps per variant per round (default 60)")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps per variant per round (default 5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="launches; each runs both variants interleaved, the first variant alternating (default 3)")
    p.add_argument("--block", type=int, default=5, help="steps per variant before switching to the other (default 5)")
    p.add_argument("--nprocs", type=int, default=2, help="processes per launch (default 2)")
    p.add_argument("--model", default="cnn", help="paratrain.models name: cnn, resnet8, ... (default cnn)")
    p.add_argument("--batch", type=int, default=64, help="per-rank batch (default 64)")
    p.add_argument("--dataset-size", type=int, default=None,
                   help="synthetic samples (default: 16 steps per epoch, so set_epoch/new epochs are exercised)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch before it is killed")
    p.add_argument("--json", default=None, metavar="PATH", help="also write all numbers to this JSON file")
    p.add_argument("--smoke", action="store_true",
                   help=f"check that the benchmark runs, quickly ({SMOKE}); the numbers mean nothing")
    args = p.parse_args(argv)
    if args.smoke:
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    for name in ("steps", "rounds", "nprocs", "batch", "threads", "block"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.nprocs < 2:
        p.error("--nprocs must be at least 2: with one process paratrain does not wrap the model in DDP")
    dataset_size = args.dataset_size or 16 * args.batch * args.nprocs
    if dataset_size < args.batch * args.nprocs:
        p.error(f"--dataset-size {dataset_size} is smaller than one global batch ({args.batch * args.nprocs})")

    cfg = {"steps": args.steps, "warmup": args.warmup, "model": args.model, "batch": args.batch,
           "dataset_size": dataset_size, "threads": args.threads, "seed": args.seed, "block": args.block}
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the spawned workers
    try:
        build_model(args.model, INPUT_SHAPE, NUM_CLASSES)  # fail fast on a bad model name
    except ValueError as e:
        p.error(str(e))

    load_start = os.getloadavg()[0]
    hardware = (f"CPU: {cpu_model()} ({os.cpu_count()} logical cores) | torch {torch.__version__} | "
                f"python {platform.python_version()} | {args.nprocs} procs x {args.threads} thread(s) | "
                f"load avg {load_start:.2f}")
    print(hardware)
    print(f"model={args.model} per-rank batch={args.batch} global batch={args.batch * args.nprocs} "
          f"dataset={dataset_size} steps={args.steps} (+{args.warmup} warm-up) "
          f"block={args.block} rounds={args.rounds}")

    times: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    cpu_times: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    worker_threads = None
    for r in range(args.rounds):
        first = VARIANTS[r % 2]  # alternate which variant is set up and stepped first
        steps, cpu, worker_threads = run_round(first, cfg, args.nprocs, args.timeout)
        for v in VARIANTS:
            times[v].append(steps[v])
            cpu_times[v].append(cpu[v])
        print(f"  round {r} ({first} first): " + ", ".join(
            f"{v} {1e3 * statistics.median(steps[v]):.2f} ms" for v in VARIANTS), flush=True)

    def flat(per_round: list[list[float]]) -> list[float]:
        return [s for steps in per_round for s in steps]

    rows = []
    print()
    print(f"{'variant':<10} {'round':>5} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'cpu ms':>8} {'steps':>6}")
    for variant in VARIANTS:
        for r, (steps, cpu) in enumerate(zip(times[variant], cpu_times[variant])):
            rows.append((variant, str(r), steps, cpu))
        rows.append((variant, "all", flat(times[variant]), flat(cpu_times[variant])))
    for variant, r, steps, cpu in rows:
        print(f"{variant:<10} {r:>5} {1e3 * statistics.median(steps):10.2f} {1e3 * _quantile(steps, 0.1):8.2f} "
              f"{1e3 * _quantile(steps, 0.9):8.2f} {1e3 * statistics.median(cpu):8.2f} {len(steps):6d}")

    med = {v: statistics.median(flat(times[v])) for v in VARIANTS}
    cpu_med = {v: statistics.median(flat(cpu_times[v])) for v in VARIANTS}
    # One round per launch here; paratrain bench's baseline cell counts one round per ABBA block pair.
    overhead = Overhead.from_rounds(times["paratrain"], times["plain"], cpu_times["paratrain"], cpu_times["plain"])
    round_ratios, ratio, cpu_ratio = overhead.rounds, overhead.ratio, overhead.cpu_ratio
    print()
    print(f"per-round ratios: {', '.join(f'{x:.3f}' for x in round_ratios)} "
          f"(median {statistics.median(round_ratios):.3f})")
    print(f"CPU-time ratio paratrain/plain = {cpu_ratio:.3f} (process CPU per step, less sensitive to other load)")
    print(f"ratio paratrain/plain = {ratio:.3f} (target <= 1.01)")
    print(f"paratrain ddp takes {overhead.describe()} the hand-written loop's step time")

    if args.json:
        out = {
            "hardware": {"cpu": cpu_model(), "logical_cores": os.cpu_count(), "torch": torch.__version__,
                         "python": platform.python_version(), "nprocs": args.nprocs,
                         "threads_per_worker": worker_threads,
                         "load_avg_1min": {"start": load_start, "end": os.getloadavg()[0]}},
            "config": cfg | {"rounds": args.rounds, "nprocs": args.nprocs},
            "median_step_ms": {v: 1e3 * med[v] for v in VARIANTS},
            "median_step_cpu_ms": {v: 1e3 * cpu_med[v] for v in VARIANTS},
            "ratio": ratio,
            "cpu_ratio": cpu_ratio,
            "round_ratios": round_ratios,
            "step_ms": {v: [[1e3 * s for s in steps] for steps in times[v]] for v in VARIANTS},
            "step_cpu_ms": {v: [[1e3 * s for s in steps] for steps in cpu_times[v]] for v in VARIANTS},
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
