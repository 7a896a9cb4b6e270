"""A classic comparison on this machine: single vs DataParallel vs DDP vs DDP with mixed precision,
on ResNet-50 (torchvision's architecture) with CIFAR-shaped synthetic data.

A widely read PyTorch tutorial on DP/DDP/AMP trained ``torchvision.models.resnet50`` on CIFAR-10 at
batch 256 and published seconds per epoch: single GPU 13.2, DataParallel on 4 GPUs 19.1, DDP on 2 GPUs 9.8, DDP
on 4 GPUs 6.1, DDP on 4 GPUs with mixed precision 6.5. Here every configuration is one ``bench``
cell (fresh processes, warm-up steps untimed), and its time per epoch is projected to CIFAR-10's
50,000 training samples from the timed steps, so the numbers compare with the published ones whatever the
synthetic set's size. A cell this machine cannot run keeps its row, with the reason.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from .. import precision as _precision
from ..config import TrainConfig
from .budget import Deadline
from .report import Report

__all__ = ["PUBLISHED_SECONDS", "seed_cells", "run_seed_table", "CIFAR10_TRAIN"]

CIFAR10_TRAIN = 50_000
PUBLISHED_SECONDS = {("one device", 1, False): 13.2, ("DataParallel", 4, False): 19.1, ("DDP", 2, False): 9.8,
                     ("DDP", 4, False): 6.1, ("DDP", 4, True): 6.5}
"""The published seconds per epoch, keyed by (configuration, GPUs, mixed precision with a loss scale)."""


def _roles() -> dict[str, str]:
    """The paratrain strategy of each published configuration, found by its class's facts."""
    from .. import strategies

    dp = next(n for n, c in strategies.STRATEGIES.items() if c.drives_all_local_devices)
    return {"one device": strategies.reference(), "DataParallel": dp, "DDP": strategies.data_parallel_reference()}


def seed_config(gpus: int) -> TrainConfig:
    """The tutorial's job: ResNet-50, global batch 256, SGD; on a CPU a batch of 32 and a few steps."""
    batch, size = (256, 256 * 12) if gpus else (32, 32 * 3)
    return TrainConfig().with_overrides({
        "model": "resnet50", "data.dataset": "synthetic", "data.synthetic_size": size, "data.augment": False,
        "parallel.global_batch": batch, "log_dir": None, "progress": False, "checkpoint_every": 0,
        "checkpoint_dir": None, "resume": False,
    })


def seed_cells(cfg: TrainConfig, world: int, gpus: int) -> list[Any]:
    """The table's configurations, in the tutorial's order, with ``skip`` set where this machine cannot
    run them."""
    from ..bench.matrix import Cell, annotate

    batch = cfg.parallel.global_batch
    ddp_world = max(1, min(world, gpus)) if gpus else world
    role = _roles()
    cells = [Cell(strategy=role["one device"], global_batch=batch),
             Cell(strategy=role["DataParallel"], world_size=max(gpus, 2), global_batch=batch)]
    for w in sorted({2, ddp_world}):
        cells.append(Cell(strategy=role["DDP"], world_size=w, global_batch=batch))
    cells += [Cell(strategy=role["DDP"], world_size=ddp_world, precision=p, global_batch=batch)
              for p in _precision.bench_defaults() if not _precision.lookup(p).reference]
    cells = annotate(cells, cfg, cfg.data.synthetic_size)
    if not gpus:  # the CPU's fp16 convolutions are reference kernels: minutes per step of ResNet-50
        cells = [replace(c, skip=c.skip or "fp16 convolutions on the CPU run in slow reference kernels: a GPU row")
                 if _precision.lookup(c.precision).param_dtype is torch.float16 else c for c in cells]
    return cells


def _cell_seconds(cfg: TrainConfig, gpus: int) -> float:
    """What one cell is expected to take, start-up and evaluation included."""
    return 20.0 if gpus else 4.0 + 0.5 * cfg.data.synthetic_size / 16


def run_seed_table(report: Report, world: int, gpus: int, deadline: Deadline,
                   progress: Callable[[str], None] = lambda s: None) -> None:
    from ..bench.matrix import BenchSpec
    from ..bench.runner import _derive, run_cells

    cfg = seed_config(gpus)
    cells = seed_cells(cfg, world, gpus)
    spec = BenchSpec(strategies=list(_roles().values()), world_sizes=[1, world], precisions=[_precision.reference()],
                     comm_hooks=["none"], epochs=1, warmup_steps=3 if gpus else 1, baseline=False, trap=False,
                     cell_timeout=120.0 if gpus else 60.0)
    data = (cfg.dataset(train=True), cfg.dataset(train=False))
    cost = _cell_seconds(cfg, gpus)
    results = []
    for cell in cells:
        if cell.skip or not deadline.allows(cost, "seed"):
            from ..bench.runner import CellResult

            why = cell.skip or f"budget: {deadline.left:.0f} s left, a cell takes about {deadline.expect(cost, 'seed'):.0f} s here"
            results.append(CellResult(cell=cell, status="skipped", reason=why))
            continue
        progress(f"seed table: {cell.label}")
        # a cell may be far slower than its estimate (bf16 convolutions on a CPU without bf16 instructions: 30x):
        # it is stopped where the budget ends, not the cell's own limit
        limit = max(5.0, min(spec.cell_timeout, deadline.left))
        with deadline.part(cost, "seed"):
            got = run_cells([cell], replace(spec, cell_timeout=limit), cfg, data, progress=False)
        results += [replace(r, status="skipped", reason=f"budget: stopped after {limit:.0f} s, where the budget ends")
                    if r.status == "failed" and "timed out" in (r.reason or "") and limit < spec.cell_timeout else r
                    for r in got]
    _derive(results)
    steps = CIFAR10_TRAIN // cfg.parallel.global_batch
    report.seed_note = (f"ResNet-50 on CIFAR-shaped synthetic data, global batch {cfg.parallel.global_batch}; "
                        f"s/epoch is the timed step x {steps} steps (one CIFAR-10 epoch); published: the tutorial's, on its GPUs")
    for r in results:
        c = r.cell
        name = {v: k for k, v in _roles().items()}.get(c.strategy)
        seed = PUBLISHED_SECONDS.get((name or "", c.world_size, _precision.lookup(c.precision).scales_loss))
        row: dict[str, Any] = {"label": c.label, "strategy": c.strategy, "world_size": c.world_size,
                               "precision": c.precision, "status": r.status, "seed_seconds": seed}
        if r.status == "ok" and r.step_time_s:
            row.update(seconds_per_epoch=r.step_time_s * steps, samples_per_s=r.samples_per_s,
                       speedup=r.speedup, peak_mem_mib=r.peak_mem_mib, step_time_s=r.step_time_s)
        else:
            row["skip"] = r.reason or r.status
        report.seed_table.append(row)
        status = "ok" if r.status == "ok" else ("FAIL" if r.status == "failed" else "skipped")
        text = (f"{row['seconds_per_epoch']:.1f} s/epoch, {r.samples_per_s:.0f} samples/s"
                if "seconds_per_epoch" in row else row["skip"])
        report.add("resnet50", c.label, status, text)
