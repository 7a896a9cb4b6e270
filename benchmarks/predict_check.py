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

Usage::

    python benchmarks/predict_check.py [--model resnet20] [--batch 64] [--rounds 2] [--epochs 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
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


def step_time(cfg: TrainConfig, strategy: str, world: int, epochs: int) -> float:
    spec = dataclasses.replace(quick_spec(), strategies=[strategy], world_sizes=[world], precisions=["32"],
                               comm_hooks=["none"], epochs=epochs, baseline=False, trap=False, nccl_cells=False)
    res = run_bench(spec, cfg, progress=False)
    ok = [r for r in res.results if r.status == "ok" and r.cell.world_size == world]
    if not ok or not ok[0].step_time_s:
        raise SystemExit(f"{strategy} x{world} did not run: {[r.reason for r in res.results]}")
    return ok[0].step_time_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet20")
    ap.add_argument("--dataset", default="synthetic")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()
    base = {"model": args.model, "data.dataset": args.dataset}
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
                (p,) = predict(Workload(c, args.batch, shapes, exposed), link, ["ddp"], [2])
                print(f"  predicted from compute {what}, exposed {exposed:.0f}: {p.step_s * 1e3:.1f} ms, error "
                      f"{100 * (p.step_s - measured) / measured:+.1f}% (communication {p.comm_s * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
