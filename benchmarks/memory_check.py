"""The memory estimate (``paratrain estimate``) against measured peaks on this machine.

What it measures
    For two models (a wide MLP and a nanoGPT-style GPT with tied weights), AdamW: single, ddp, fsdp
    and tensor at world sizes 1 and 2 (single at 1) and pipeline at 2 in fp32, and bf16-true (bf16
    weights, fp32 masters) and bf16-mixed for single and ddp, and the composed layouts HSDP 2x2,
    ``pp=2,dp_shard=2``, ``dp_shard=2,tp=2`` and ``pp=2,tp=2`` at world size 4 (``Parallel(mesh=...)``,
    estimated with ``estimate(mesh=...)``); each rank's peak memory over three
    training steps through ``Parallel``, from building the model on, with ``BATCH`` samples per
    data shard and forward. On a CPU that is the peak
    resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the resident set just
    before the model is built, after one untimed run of the same job in the same process (so
    code pages, thread stacks and the process group are in the baseline, not in the peak). On a
    GPU it is ``torch.cuda.max_memory_allocated``. The estimate comes from
    :func:`paratrain.bench.memory.estimate` with facts measured on the meta device.

Target
    every estimate within 15% of the measured peak (the largest rank's).

Usage::

    python benchmarks/memory_check.py [--smoke] [--json PATH] [--only PREFIX]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import paratrain  # noqa: E402
from paratrain.bench.measure import PeakMemory  # noqa: E402
from paratrain.bench.memory import estimate, measure_model  # noqa: E402
from paratrain.strategies import resolve  # noqa: E402
from paratrain.strategies.base import data_parallel_size  # noqa: E402

CASES = [("single", 1, "32"), ("ddp", 1, "32"), ("ddp", 2, "32"), ("fsdp", 1, "32"), ("fsdp", 2, "32"),
         ("tensor", 1, "32"), ("tensor", 2, "32"), ("pipeline", 2, "32"), ("single", 1, "bf16-true"),
         ("ddp", 2, "bf16-true"), ("single", 1, "bf16-mixed"), ("ddp", 2, "bf16-mixed"),
         # composed layouts (paratrain.strategies.mesh), at world size 4
         ("mesh:dp_replicate=2,dp_shard=2", 4, "32"), ("mesh:pp=2,dp_shard=2", 4, "32"),
         ("mesh:dp_shard=2,tp=2", 4, "32"), ("mesh:pp=2,tp=2", 4, "32")]
SMOKE = [("single", 1, "32"), ("mesh:dp_shard=2", 2, "32"), ("tensor", 2, "32"), ("single", 1, "bf16-true")]
"""A strategy ``mesh:SIZES`` is the layout ``Parallel(mesh=...)`` with those sizes (``--mesh``'s spelling)."""


def layout(strategy: str) -> dict[str, int] | None:
    """The mesh sizes of a ``mesh:...`` case (None: a strategy's)."""
    if not strategy.startswith("mesh:"):
        return None
    return {k: int(v) for k, _, v in (item.partition("=") for item in strategy[5:].split(","))}
SIZES = {  # model sizes: full run / --smoke
    "mlp": {"full": dict(width=2048, depth=3, inputs=1024), "smoke": dict(width=256, depth=2, inputs=128)},
    "gpt": {"full": dict(n_layer=4, n_embd=384, vocab=4096, block=64), "smoke": dict(n_layer=2, n_embd=64, vocab=256,
                                                                                       block=16)},
}
BATCH = {"mlp": 64, "gpt": 8}
# glibc serves a large block from the heap once a block of its size was freed (its mmap threshold
# grows), and keeps freed heap memory: the second run would reuse the first's and show no peak.
# A fixed threshold maps every block over 64 KiB on its own and unmaps it when freed, so the
# resident set follows the live tensors.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


class WideMLP(nn.Sequential):
    def __init__(self, width: int, depth: int, inputs: int, classes: int = 10) -> None:
        layers: list[nn.Module] = [nn.Linear(inputs, width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        super().__init__(*layers, nn.Linear(width, classes))


def builder(name: str, size: dict[str, int]) -> Any:
    if name == "mlp":
        return lambda: WideMLP(**size)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import zoo

    return lambda: zoo.GPT(n_layer=size["n_layer"], n_embd=size["n_embd"], vocab=size["vocab"], block_size=size["block"])


def batch(name: str, size: dict[str, int], k: int, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    if name == "mlp":
        return torch.randn(k, size["inputs"], generator=g).to(device), torch.randint(0, 10, (k,), generator=g).to(device)
    ids = torch.randint(0, size["vocab"], (k, size["block"]), generator=g)
    return ids.to(device), ids.roll(-1, dims=1).to(device)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def _train(pt: Any, name: str, size: dict[str, int], steps: int) -> None:
    model = builder(name, size)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = pt.setup(model, opt)
    for _ in range(steps):
        x, y = batch(name, size, BATCH[name], pt.device)
        opt.zero_grad()
        pt.training_step(model, (x, y), loss_fn)  # forward and backward (a pipeline's stages: its schedule)
        opt.step()
    del model, opt


def worker(rank: int, name: str, size: dict[str, int], strategy: str, precision: str, steps: int) -> int:
    torch.set_num_threads(1)
    mesh = layout(strategy)
    # tensor/pipeline: 1
    shards = data_parallel_size(mesh) if mesh else resolve(strategy).data_parallel_size_for(int(os.environ["WORLD_SIZE"]))
    how: dict[str, Any] = {"mesh": mesh} if mesh else {"strategy": strategy}

    def parallel() -> Any:
        return paratrain.Parallel(**how, precision=precision, global_batch=BATCH[name] * shards,
                                  micro_batch=BATCH[name])

    pt = parallel()
    _train(pt, name, size, steps)  # untimed: kernels, threads and buffers are loaded, then freed
    del pt  # it holds the first run's model and optimizer; the next one joins the same process group
    gc.collect()
    pt = parallel()
    memory = PeakMemory(pt.device)
    memory.reset()
    base = memory.current()
    _train(pt, name, size, steps)
    peak = memory.read() - base
    pt.close()
    return peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models, one case per strategy: checks the script runs")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", default=None, metavar="PREFIX", help="the cases whose strategy starts so (e.g. mesh:)")
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "full"
    os.environ.update(MALLOC)  # glibc reads them when a process starts: the workers inherit them
    cases = [c for c in (SMOKE if args.smoke else CASES) if args.only is None or c[0].startswith(args.only)]
    rows = []
    print(f"{'model':<5} {'strategy':<30} {'world':>5} {'precision':<10} {'measured MiB':>13} {'estimate MiB':>13} "
          f"{'error':>7}")
    for name in SIZES:
        size = SIZES[name][mode]
        facts = measure_model(builder(name, size), lambda k, name=name, size=size: batch(name, size, k)[0],
                              lambda out, k, name=name, size=size: loss_fn(out, batch(name, size, k)[1]))
        for strategy, world, precision in cases:
            if args.smoke and (name == "mlp") == (strategy == "tensor"):
                continue  # smoke: each code path once (the mlp unsplit and sharded, the GPT's fused split)
            peaks = paratrain.launch(worker, nprocs=world, args=(name, size, strategy, precision, args.steps),
                                     timeout=600, env={"OMP_NUM_THREADS": "1"},
                                     start_method="forkserver", preload=["paratrain"])
            measured = max(peaks)
            est = estimate(facts, strategy, world, BATCH[name], precision=precision, optimizer="adamw",
                           mesh=layout(strategy)).peak
            err = est / measured - 1 if measured > 0 else math.nan  # a tiny smoke model may not move the peak
            rows.append({"model": name, "strategy": strategy, "world_size": world, "precision": precision,
                         "measured": measured, "estimate": est, "error": err, "params": facts.params})
            print(f"{name:<5} {strategy:<30} {world:>5} {precision:<10} {measured / 2**20:>13.1f} "
                  f"{est / 2**20:>13.1f} {err:>+7.1%}", flush=True)
    worst = max((abs(r["error"]) for r in rows if math.isfinite(r["error"])), default=math.nan)
    print(f"largest error {worst:.1%} (target: within 15%{'; smoke sizes: not a check' if args.smoke else ''})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
