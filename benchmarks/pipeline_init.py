"""A pipeline built under ``init_module``: each rank's peak host memory against the whole build's.

What it measures
    A nanoGPT-style GPT of about 92 M parameters (12 blocks, 768 wide, a vocabulary of 8,192 so
    that the tied embedding does not outweigh a stage's blocks), trained one SGD step under
    ``Parallel(strategy="pipeline")`` at ``pp=4`` (four processes on this host), built two ways:
    whole (every rank builds the whole model, then keeps its stage) and under ``pt.init_module()``
    (built on the meta device; each rank materialises its own stage only). For each rank, the
    peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) from just before the
    model is built to the end of setup, and to the end of the step, minus the resident set at that start. A tiny run of
    the same job comes first in each process, so that code pages, thread stacks and the process
    group are in the baseline, not in the peak.

Target
    under ``init_module``, every rank's peak once built and set up is under 40% of the whole
    build's (a stage is a quarter of the model, plus the largest tensor being valued). The peak
    through the step is printed too: both builds add the same gradients and activations there.

Usage::

    python benchmarks/pipeline_init.py [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import torch
from torch.nn import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import paratrain  # noqa: E402
from paratrain.bench.measure import PeakMemory  # noqa: E402

FULL = {"n_layer": 12, "n_embd": 768, "vocab": 8192, "block": 64, "world": 4}
SMOKE = {"n_layer": 4, "n_embd": 64, "vocab": 256, "block": 16, "world": 2}
TINY = {"n_layer": 4, "n_embd": 16, "vocab": 32, "block": 8}
TARGET = 0.40


def _step(size: dict[str, int], deferred: bool, memory: PeakMemory | None = None, base: int = 0) -> int:
    """Build, set up and train one step; the peak over ``base`` once set up (0 without ``memory``)."""
    import zoo

    pt = paratrain.Parallel(strategy="pipeline", global_batch=4, seed=0)
    with pt.init_module() if deferred else contextlib.nullcontext():
        model = zoo.GPT(n_layer=size["n_layer"], n_embd=size["n_embd"], vocab=size["vocab"], block_size=size["block"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = pt.setup(model, opt)
    built = memory.read() - base if memory is not None else 0
    ids = torch.randint(0, size["vocab"], (4, size["block"]), generator=torch.Generator().manual_seed(0))
    opt.zero_grad()
    pt.training_step(model, (ids, ids.roll(-1, dims=1)),
                     lambda out, y: F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1)))
    opt.step()
    del model, opt
    return built


def worker(rank: int, size: dict[str, int], deferred: bool) -> tuple[int, int]:
    """This rank's peaks (bytes over its baseline): built and set up, and through the step."""
    torch.set_num_threads(1)
    _step(TINY, deferred)  # the process group, code and threads: in the baseline
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    base = memory.current()
    built = _step(size, deferred, memory, base)
    peak = memory.read() - base
    paratrain.Parallel(strategy="pipeline").close()
    return built, peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny GPT at pp=2: that it runs, not its numbers")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    size = SMOKE if args.smoke else FULL
    world = size["world"]
    params = 12 * size["n_layer"] * size["n_embd"] ** 2 + size["vocab"] * size["n_embd"]
    print(f"GPT {size['n_layer']} blocks x {size['n_embd']}, vocabulary {size['vocab']} (~{params / 1e6:.0f} M "
          f"parameters, fp32), pipeline pp={world}, one SGD step; each rank's peak RSS over its baseline")
    peaks = {deferred: paratrain.launch(worker, nprocs=world, args=(size, deferred), timeout=900,
                                              start_method="forkserver", preload=["paratrain"])
             for deferred in (False, True)}
    rows = []
    print(f"{'':>4}  {'built and set up':^34}  {'through one step':^34}")
    print(f"{'rank':>4}  {'whole':>10}  {'init_module':>11}  {'ratio':>7}  {'whole':>10}  {'init_module':>11}  {'ratio':>7}")
    for rank in range(world):
        (whole_built, whole_step), (deferred_built, deferred_step) = peaks[False][rank], peaks[True][rank]
        row = {"rank": rank, "whole_built_bytes": whole_built, "init_module_built_bytes": deferred_built,
               "built_ratio": deferred_built / whole_built, "whole_step_bytes": whole_step,
               "init_module_step_bytes": deferred_step, "step_ratio": deferred_step / whole_step}
        rows.append(row)
        print(f"{rank:>4}  {whole_built / 2**20:>7.0f} MB  {deferred_built / 2**20:>8.0f} MB  {row['built_ratio']:>7.0%}  "
              f"{whole_step / 2**20:>7.0f} MB  {deferred_step / 2**20:>8.0f} MB  {row['step_ratio']:>7.0%}")
    worst = max(r["built_ratio"] for r in rows)
    print(f"largest ratio built and set up {worst:.0%} (target: under {TARGET:.0%}"
          f"{'; smoke size, not checked' if args.smoke else ''}); through the step "
          f"{max(r['step_ratio'] for r in rows):.0%} (the stage's gradients are the same in both)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "rows": rows, "target": TARGET}, f, indent=1)
    return 0 if args.smoke or worst < TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
