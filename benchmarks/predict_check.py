"""Check ``paratrain bench --predict`` against a measurement at 2 workers on loopback gloo.

What it measures
    Weak scaling, as the predictor models it: ``single`` at global batch ``B`` (the compute time),
    then ``ddp`` on 2 processes at global batch ``2B`` (each worker keeps ``B``), both through
    ``paratrain.bench.run_bench`` (fresh processes, warm-up steps excluded, median step time). The
    link is fitted to gloo all-reduces between 2 local processes. Printed: the measured 2-worker
    step time, the predicted one with all communication exposed (1) and with none (0), and the error
    of each in %; with the compute measured alone (what ``bench --predict`` uses) and with two
    single runs at once (the CPU load of 2 workers on this host, without communication), which
    separates the communication model from the host running out of cores. ``--rounds`` repeats everything (the machine is shared: read the spread).

With ``--lab`` (root, ``ip netns``): the same check across the hosts of ``scripts/lab`` on
rate-limited links (``--rates``: tc rates; ``none``: the veths unshaped; ``loopback``: the N
workers on one host), at 2 and 3 workers, one worker per host. Compute is ``single`` at the
per-worker batch, alone and as N runs at once on N hosts (the cores N workers leave each other);
ddp runs at N times the batch. Every time is the mean step of a ``paratrain train`` run after its
first 5 steps (``train.csv``). The link is the rate given to ``tc`` with the latency fitted to local gloo
all-reduces (unshaped: the fitted link); all communication is taken as exposed.

Usage::

    python benchmarks/predict_check.py [--model resnet20] [--batch 64] [--rounds 2] [--epochs 1]
    python benchmarks/predict_check.py --lab [--model mlp] [--rates 100mbit,1gbit] [--workers 2,3]
    python benchmarks/predict_check.py --smoke   # one round, mlp, 256 samples: checks that it runs (CI)

``--smoke`` runs the loopback check (without ``--lab``, which needs root) at tiny sizes; flags given
explicitly still win.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any
from concurrent.futures import ThreadPoolExecutor

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from paratrain.bench import quick_spec, run_bench  # noqa: E402
from paratrain.bench.predict import Workload, predict  # noqa: E402
from paratrain.bench.scaling import measured_link  # noqa: E402
from paratrain.config import TrainConfig  # noqa: E402
from paratrain.data.datasets import dataset_info  # noqa: E402
from paratrain.models import build_model  # noqa: E402
from paratrain.bench.predict import Link  # noqa: E402


def step_time(cfg: TrainConfig, strategy: str, world: int, epochs: int) -> float:
    spec = dataclasses.replace(quick_spec(), strategies=[strategy], world_sizes=[world], precisions=["32"],
                               comm_hooks=["none"], epochs=epochs, baseline=False, trap=False, nccl_cells=False)
    res = run_bench(spec, cfg, progress=False)
    ok = [r for r in res.results if r.status == "ok" and r.cell.world_size == world]
    if not ok or not ok[0].step_time_s:
        raise SystemExit(f"{strategy} x{world} did not run: {[r.reason for r in res.results]}")
    return ok[0].step_time_s


WINDOW = 5  # steps per logged window; the first window (warm-up) is left out


def lab_runs(hosts, runs: list[tuple[int, list[str]]], out: str) -> list[Any]:
    """``paratrain train ARGS`` for every ``(host, ARGS)`` at once, each on its lab host; the mean
    step time of each after its first :data:`WINDOW` steps (None for a run that logs nothing:
    not rank 0)."""
    import csv
    import signal
    import statistics
    import subprocess

    base = [sys.executable, "-m", "paratrain", "train", "--epochs", "1000", "--no-progress",
            "--set", f"log_every={WINDOW}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_ROOT)
    dirs = [f"{out}/{i}" for i in range(len(runs))]
    procs = [subprocess.Popen(hosts.exec_argv(h, [*base, *a, "--log-dir", d]), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
             for (h, a), d in zip(runs, dirs)]
    try:
        for p, (h, a) in zip(procs, runs):
            _, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"paratrain train {' '.join(a)} on lab host {h} failed: {err[-2000:]}")
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    times = []
    for d in dirs:  # rank 0's log: the step time of each window of --log-every steps after the first
        if not os.path.exists(f"{d}/train.csv"):
            times.append(None)
            continue
        with open(f"{d}/train.csv") as f:
            rows = list(csv.DictReader(f))[1:]
        times.append(statistics.mean(float(row["step_time_s"]) for row in rows) if rows else None)
    return times


def lab_check(args: argparse.Namespace) -> None:
    import tempfile

    from scripts.lab import hosts

    why = hosts.unavailable()
    if why:
        raise SystemExit(f"--lab: {why}")
    workers = [int(w) for w in args.workers.split(",")]
    job = ["--model", args.model, "--dataset", args.dataset]
    info = dataset_info(args.dataset)
    shapes = tuple(tuple(p.shape) for p in build_model(args.model, tuple(info["input_shape"]),
                                                        info["num_classes"]).parameters())
    fitted = measured_link()
    print(f"{args.model} on {args.dataset}, {len(shapes)} tensors, "
          f"{4 * Workload(1.0, 1, shapes).params / 2**20:.2f} MiB of fp32 gradients, batch {args.batch} per worker, "
          f"{args.steps} steps per run; link fitted to local gloo: {fitted.describe()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("compute: single at the per-worker batch, alone (what bench --predict uses) and as N singles at once "
          "(N workers' share of this machine's cores, without communication)")
    hosts.up(max(workers))
    out = tempfile.mkdtemp(prefix="paratrain-predict-lab-")
    single = [*job, "--strategy", "single", "--global-batch", str(args.batch), "--max-steps", str(args.steps)]
    try:
        for r in range(args.rounds):
            hosts.net()
            alone = lab_runs(hosts, [(0, single)], f"{out}/r{r}-alone")[0]
            at_once = {n: max(lab_runs(hosts, [(k, single) for k in range(n)], f"{out}/r{r}-once{n}"))
                       for n in workers}
            print(f"round {r + 1}: compute alone {alone * 1e3:.1f} ms/step, "
                  + ", ".join(f"{n} at once {t * 1e3:.1f} ms" for n, t in at_once.items()))
            for rate in args.rates.split(","):
                hosts.net(rate=rate if rate not in ("none", "loopback") else None)
                link = fitted if rate in ("none", "loopback") else Link.parse(f"{rate},{fitted.latency_s}s")
                for n in workers:
                    ddp = [*job, "--strategy", "ddp", "--global-batch", str(n * args.batch), "--max-steps", str(args.steps)]
                    if rate == "loopback":  # n processes on one host
                        runs = [(0, [*ddp, "--nproc-per-node", str(n)])]
                    else:  # one process on each of n hosts
                        runs = [(k, [*ddp, "--nproc-per-node", "1", "--nnodes", str(n), "--node-rank", str(k),
                                     "--master-addr", hosts.addr(0), "--master-port", "29518"]) for k in range(n)]
                    measured = lab_runs(hosts, runs, f"{out}/r{r}-{rate}-{n}")[0]
                    cells = []
                    for what, c in (("alone", alone), ("at once", at_once[n])):
                        (p,) = predict(Workload(c, args.batch, shapes, 1.0), link, ["all-reduce (ddp)"], [n])
                        cells.append(f"{what} {p.step_s * 1e3:6.1f} ms ({100 * (p.step_s - measured) / measured:+.1f}%)")
                    print(f"  {rate:>8s} x{n}: measured {measured * 1e3:6.1f} ms; communication {p.comm_s * 1e3:6.1f} ms; "
                          f"predicted from compute " + ", ".join(cells))
    finally:
        hosts.down()


SMOKE = {"model": "mlp", "batch": 16, "rounds": 1, "epochs": 1, "synthetic_size": 256}
"""``--smoke``: what CI runs (``tests/test_benchmarks.py``)."""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default resnet20 (mlp with --lab)")
    ap.add_argument("--dataset", default="synthetic")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--synthetic-size", type=int, default=None,
                    help="training samples of --dataset synthetic (default: the config's, 4096)")
    ap.add_argument("--lab", action="store_true", help="check on rate-limited links between lab hosts")
    ap.add_argument("--rates", default="loopback,none,100mbit,1gbit",
                    help="--lab: link rates, tc syntax; none: unshaped; loopback: all workers on one host")
    ap.add_argument("--workers", default="2,3", help="--lab: worker (host) counts")
    ap.add_argument("--steps", type=int, default=20, help="--lab: steps per run (the first 5 are left out)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"check that the loopback check runs, quickly ({SMOKE}); the numbers mean nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        if args.lab:
            ap.error("--smoke runs the loopback check, not --lab (which needs root and network namespaces)")
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    if args.lab:
        args.model = args.model or "mlp"
        return lab_check(args)
    args.model = args.model or "resnet20"
    base = {"model": args.model, "data.dataset": args.dataset}
    if args.synthetic_size is not None:
        base["data.synthetic_size"] = args.synthetic_size
    one = TrainConfig.load(None, {**base, "parallel.global_batch": args.batch})
    two = TrainConfig.load(None, {**base, "parallel.global_batch": 2 * args.batch})
    info = dataset_info(args.dataset)
    shapes = tuple(tuple(p.shape) for p in build_model(args.model, tuple(info["input_shape"]),
                                                        info["num_classes"]).parameters())
    print(f"{args.model} on {args.dataset}, {sum(1 for _ in shapes)} tensors, batch {args.batch} per worker, "
          f"load average {os.getloadavg()[0]:.1f}")
    for r in range(args.rounds):
        link = measured_link()
        compute = step_time(one, "single", 1, args.epochs)
        with ThreadPoolExecutor(2) as pool:  # two single runs at once: compute under 2 workers' CPU load
            together = max(pool.map(lambda _: step_time(one, "single", 1, args.epochs), range(2)))
        measured = step_time(two, "ddp", 2, args.epochs)
        print(f"round {r + 1}: link {link.describe()}; single alone {compute * 1e3:.1f} ms, two singles at once "
              f"{together * 1e3:.1f} ms (slower), ddp x2 measured {measured * 1e3:.1f} ms")
        for what, c in (("alone", compute), ("two at once", together)):
            for exposed in (1.0, 0.0):
                (p,) = predict(Workload(c, args.batch, shapes, exposed), link, ["all-reduce (ddp)"], [2])
                print(f"  predicted from compute {what}, exposed {exposed:.0f}: {p.step_s * 1e3:.1f} ms, error "
                      f"{100 * (p.step_s - measured) / measured:+.1f}% (communication {p.comm_s * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
