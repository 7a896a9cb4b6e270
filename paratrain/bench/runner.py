"""Run every cell of the matrix in fresh processes, each with a hard time limit, and derive the table's numbers.

Each runnable cell is one :func:`paratrain.launch` of ``world_size`` new processes (one for ``dp``):
nothing is shared between cells, so one cell's allocator, threads or process group cannot make
the next look faster or slower. The processes fork from a ``forkserver`` that imported this
package's worker (and so torch) once, before any cell ran: a cell does not pay python's and
torch's start-up again, which was most of a small cell's time on a CPU (``--quick`` went from
115 s to 14 s of CPU time). The server only imports (importing torch does not initialise CUDA),
so each worker still initialises CUDA, its threads and its process group itself. Past ``cell_timeout`` every process of the cell is killed and the
cell is reported as failed. Cells that train identically (same :meth:`Cell.run_key`) run once.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import platform
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import precision as _precision
from ..config import TrainConfig
from ..launch.spawn import LaunchError, launch
from .matrix import BASELINE, BenchSpec, Cell, build_matrix, cuda_devices
from .measure import load_avg
from .overhead import Overhead
from .worker import cell_config, run_cell

__all__ = ["CellResult", "BenchResult", "run_bench", "run_cells", "recommend", "reference"]

_SMALL_DATA = ("digits", "synthetic")  # built once in the parent and handed to the workers


@dataclass(kw_only=True)
class CellResult:
    """A cell and what it measured (``status`` ok), or why it did not run (skipped/failed)."""

    cell: Cell
    status: str
    """ok, skipped or failed."""
    reason: str | None = None
    seconds_per_epoch: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    speedup: float | None = None
    """Single's time per epoch / this cell's."""
    efficiency: float | None = None
    """speedup / world size."""
    peak_mem_mib: float | None = None
    """Largest over the cell's processes."""
    mem_method: str | None = None
    comm_bytes_per_step: float | None = None
    """Per rank per optimizer step (see :mod:`paratrain.bench.measure`)."""
    comm_by_dimension: dict[str, float] | None = None
    """The same rank's bytes per step by the layout dimension they went over (``pp``, ``dp_shard``, ``tp``...)."""
    skipped_steps: int | None = None
    final_loss: float | None = None
    """Mean training loss over the last epoch."""
    test_loss: float | None = None
    test_accuracy: float | None = None
    steps: int | None = None
    timed_steps: int | None = None
    step_mean_s: float | None = None
    """Mean step time over the timed window (``step_time_s`` is the median on CPU)."""
    wall_s: float | None = None
    """Seconds for the whole cell, process start-up and evaluation included."""
    overhead: Overhead | None = None
    """Baseline cells: paratrain ddp's step time over this loop's, interleaved in the same processes."""

    def row(self) -> dict[str, Any]:
        """Flat dict for JSON/CSV: the cell's fields, then the measurements."""
        out = {"label": self.cell.label, **dataclasses.asdict(self.cell)}
        out.pop("skip", None)
        out.update({k: v for k, v in dataclasses.asdict(self).items() if k not in ("cell", "overhead")})
        o = self.overhead
        out.update({"overhead_ratio": o and o.ratio, "overhead_rounds": o and o.rounds,
                    "overhead_cpu_ratio": o and o.cpu_ratio, "overhead_within_noise": o and o.within_noise})
        return out


@dataclass(kw_only=True)
class BenchResult:
    meta: dict[str, Any]
    results: list[CellResult] = field(default_factory=list)
    recommendation: CellResult | None = None


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "gpus": gpus,
            "gpu": torch.cuda.get_device_name(0) if gpus else None, "torch": torch.__version__,
            "python": platform.python_version(), "load_avg_start": load_avg()}


def _job_data(cfg: TrainConfig) -> Any:
    if cfg.data.dataset not in _SMALL_DATA:
        return None
    return cfg.dataset(train=True), cfg.dataset(train=False)


def _run_one(cell: Cell, spec: BenchSpec, base: TrainConfig, data: Any) -> CellResult:
    job = {"cell": cell, "config": cell_config(base, cell, spec.epochs), "warmup_steps": spec.warmup_steps,
           "threads": spec.threads, "data": data, "timeout": spec.cell_timeout}
    env = {"OMP_NUM_THREADS": str(spec.threads)}
    nprocs = cell.world_size
    if cell.strategy_class.drives_all_local_devices:  # one process over the first world_size of the GPUs it may use
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(cell.world_size)]
        nprocs, env["CUDA_VISIBLE_DEVICES"] = 1, ",".join(ids[: cell.world_size])
    start = time.perf_counter()
    for attempt in (1, 2):
        try:
            # Fresh processes, forked from a server that imported the worker once: a cell's start-up
            # is not python's and torch's again (most of a small cell's time on a CPU).
            ranks = launch(run_cell, nprocs, args=(job,), timeout=spec.cell_timeout, env=env,
                           start_method="forkserver", preload=["paratrain.bench.worker"])
            break
        except LaunchError as e:
            # torch 2.13's gloo threads now and then abort a worker as it exits (SIGABRT, "terminate
            # called without an active exception"): run such a cell once more before calling it failed.
            if attempt == 1 and f"exited with code -{int(signal.SIGABRT)}" in str(e):  # not an OOM kill (-9)
                start = time.perf_counter()  # the cell's time is the run that counts
                continue
            reason = str(e) + (" (twice)" if attempt == 2 else "")
            return CellResult(cell=cell, status="failed", reason=reason, wall_s=time.perf_counter() - start)
    wall = time.perf_counter() - start
    for status in ("failed", "skipped"):  # reported by a rank that caught its error (bench/worker.py)
        said = next((r for r in ranks if r.get("status") == status), None)
        if said is not None:
            return CellResult(cell=cell, status=status, reason=said["reason"], wall_s=wall)
    r0 = ranks[0]
    busiest = max(ranks, key=lambda r: r["comm_bytes_per_step"])
    step_time = max(r["step_time_s"] for r in ranks)  # a step is as slow as its slowest rank
    return CellResult(
        cell=cell, status="ok", seconds_per_epoch=step_time * r0["steps_per_epoch"],
        samples_per_s=r0["global_batch"] / step_time, step_time_s=step_time,
        peak_mem_mib=None if r0["peak_mem_bytes"] is None else max(r["peak_mem_bytes"] for r in ranks) / 2**20,
        mem_method=r0["mem_method"],
        # the busiest rank's payload (pipeline stages differ; the other strategies are symmetric)
        comm_bytes_per_step=busiest["comm_bytes_per_step"], comm_by_dimension=busiest.get("comm_by_dimension"),
        skipped_steps=r0["skipped_steps"],
        final_loss=r0["final_loss"], test_loss=r0["test_loss"], test_accuracy=r0["test_accuracy"],
        steps=r0["steps"], timed_steps=r0["timed_steps"], step_mean_s=max(r["step_mean_s"] for r in ranks),
        wall_s=wall, overhead=_overhead(ranks),
    )


def _overhead(ranks: list[dict[str, Any]]) -> Overhead | None:
    """The interleaved rounds of a baseline cell, a step as slow as its slowest rank (CPU: mean over ranks)."""
    if "overhead" not in ranks[0]:
        return None

    def steps(kind: str, variant: str, combine: Callable[[tuple[float, ...]], float]) -> list[list[float]]:
        per_rank = [r["overhead"][kind][variant] for r in ranks]
        return [[combine(step) for step in zip(*blocks)] for blocks in zip(*per_rank)]

    def mean(xs: tuple[float, ...]) -> float:
        return sum(xs) / len(xs)

    return Overhead.from_rounds(steps("wall", "paratrain", max), steps("wall", "plain", max),
                                steps("cpu", "paratrain", mean), steps("cpu", "plain", mean))


def run_cells(cells: list[Cell], spec: BenchSpec, base: TrainConfig, data: Any = None,
              progress: bool = True, on_result: Callable[[CellResult], None] | None = None) -> list[CellResult]:
    """Run ``cells`` one after the other (skipped ones are only recorded), with a progress bar."""
    from tqdm.auto import tqdm

    done: dict[tuple[Any, ...], CellResult] = {}
    results = []
    bar = tqdm(cells, desc="bench", unit="cell", disable=not progress, dynamic_ncols=True)
    for cell in bar:
        bar.set_postfix_str(cell.label, refresh=True)
        if cell.skip:
            result = CellResult(cell=cell, status="skipped", reason=cell.skip)
        elif cell.run_key() in done:  # e.g. the trap's same-batch cell is the matrix's ddp cell
            result = dataclasses.replace(done[cell.run_key()], cell=cell)
        else:
            result = _run_one(cell, spec, base, data)
            done[cell.run_key()] = result
        results.append(result)
        if on_result is not None:
            on_result(result)
    bar.close()
    _derive(results)
    return results


def reference(results: list[CellResult]) -> CellResult | None:
    """The single-device fp32 run every other cell is compared with."""
    for r in results:
        if r.status == "ok" and r.cell.strategy_class.reference and r.cell.precision == _precision.reference():
            return r
    return next((r for r in results if r.status == "ok" and r.cell.world_size == 1), None)


def _derive(results: list[CellResult]) -> None:
    ref = reference(results)
    if ref is None or not ref.seconds_per_epoch:
        return
    for r in results:
        if r.status == "ok" and r.seconds_per_epoch:
            r.speedup = ref.seconds_per_epoch / r.seconds_per_epoch
            r.efficiency = r.speedup / r.cell.world_size


NOISE = 0.05
"""Cells within this fraction of the fastest count as equally fast: one run per cell on a shared
machine does not tell them apart."""


def recommend(results: list[CellResult], tolerance: float) -> CellResult | None:
    """The fastest paratrain configuration whose test accuracy is within ``tolerance`` of single's,
    at the job's global batch (a cell that grew it trains something else: the effective-batch trap).

    Among the cells within :data:`NOISE` of the fastest, the one with the fewest processes wins,
    and at one process the single-device reference: a configuration is only recommended over a
    simpler one for a difference the measurement can show."""
    ref = reference(results)
    if ref is None or ref.test_accuracy is None:
        return None
    keep = [r for r in results if r.status == "ok" and r.cell.strategy != BASELINE and r.test_accuracy is not None
            and r.test_accuracy >= ref.test_accuracy - tolerance and r.seconds_per_epoch
            and r.cell.global_batch == ref.cell.global_batch]
    if not keep:
        return None
    best = min(r.seconds_per_epoch for r in keep)  # type: ignore[type-var]
    tied = [r for r in keep if r.seconds_per_epoch <= best * (1 + NOISE)]  # type: ignore[operator]
    return min(tied, key=lambda r: (r.cell.world_size, r is not ref, r.seconds_per_epoch))


def run_bench(spec: BenchSpec, cfg: TrainConfig, progress: bool = True,
              on_result: Callable[[CellResult], None] | None = None) -> BenchResult:
    """Build the matrix for ``spec`` over the base config ``cfg`` and run it."""
    data = _job_data(cfg)
    train_size = len(data[0]) if data is not None else cfg.train_size()  # type: ignore[arg-type]
    cells = build_matrix(spec, cfg, train_size)
    start = time.perf_counter()
    results = run_cells(cells, spec, cfg, data, progress, on_result)
    meta = {
        "machine": {**_machine(), "load_avg_end": load_avg()},
        "model": cfg.model, "dataset": cfg.data.dataset, "train_size": train_size,
        "global_batch": cfg.parallel.global_batch, "optimizer": cfg.optim.name, "lr": cfg.optim.lr,
        "spec": dataclasses.asdict(spec), "base_config": cfg.to_dict(), "runs_per_cell": 1,
        "bench_seconds": time.perf_counter() - start,
        "memory": next((r.mem_method for r in results if r.mem_method), None),
        "timing": "mean step of a synchronised window" if cuda_devices(cfg.parallel.accelerator) else "median step",
    }
    return BenchResult(meta=meta, results=results, recommendation=recommend(results, spec.tolerance))
