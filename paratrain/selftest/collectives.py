"""Collective health: ``all_reduce`` and ``all_gather`` latency and bus bandwidth, as nccl-tests
computes them, over several message sizes on the backend training would use.

For a message of S bytes taking t seconds on n ranks (nccl-tests' ``doc/PERFORMANCE.md``):

* ``algbw = S / t``; for ``all_gather`` S is the gathered output (n × each rank's part);
* ``busbw = algbw × 2(n−1)/n`` for ``all_reduce``, ``algbw × (n−1)/n`` for ``all_gather``: the
  traffic each link carries, comparable with the hardware's link bandwidth whatever n is.

Each rank times every operation between barriers (CUDA: synchronised); a size's time is the
slowest rank's median.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist

from ..launch.spawn import LaunchError, launch
from .budget import Deadline
from .report import FAIL, OK, SKIPPED, Report

__all__ = ["bus_bandwidth", "measure", "run_collectives", "SIZES"]

SIZES = {"cpu": (2**12, 2**16, 2**20, 2**22), "cuda": (2**12, 2**16, 2**20, 2**24, 2**27, 2**29)}
"""Bytes per message: 4 KiB to 4 MiB on the CPU (gloo), to 512 MiB on GPUs (nccl)."""

STARTUP_SECONDS = 10.0
"""What starting the processes and their group takes before the first size is measured."""

FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}


def bus_bandwidth(collective: str, nbytes: float, seconds: float, world: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in bytes/s of one ``collective`` moving ``nbytes`` in ``seconds`` on
    ``world`` ranks (``nbytes``: the reduced buffer, or the gathered output)."""
    algbw = nbytes / seconds
    return algbw, algbw * FACTORS[collective](world)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(local_rank: int, backend: str, accelerator: str, sizes: tuple[int, ...], seconds_per_size: float
            ) -> dict[str, list[tuple[int, float]]]:
    """In a launched worker: ``{collective: [(bytes, median seconds), ...]}`` for this rank."""
    device = torch.device("cuda", local_rank) if accelerator == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        n = dist.get_world_size()
        out: dict[str, list[tuple[int, float]]] = {"all_reduce": [], "all_gather": []}
        for nbytes in sizes:
            for name in out:
                if name == "all_reduce":
                    op = functools.partial(dist.all_reduce, torch.ones(nbytes // 4, device=device))
                else:
                    part = torch.ones(max(1, nbytes // 4 // n), device=device)
                    op = functools.partial(dist.all_gather, [torch.empty_like(part) for _ in range(n)], part)
                times = []
                for i in range(1000):
                    dist.barrier()
                    _sync(device)
                    t0 = time.perf_counter()
                    op()
                    _sync(device)
                    if i >= 2:  # the first two warm up the backend's buffers and connections
                        times.append(time.perf_counter() - t0)
                    # every rank stops at the same count: rank 0's clock decides for all
                    done = torch.tensor([len(times) >= 3 and (sum(times) > seconds_per_size or len(times) >= 50)],
                                        dtype=torch.int32, device=device)
                    dist.broadcast(done, 0)
                    if done.item():
                        break
                out[name].append((nbytes, statistics.median(times)))
                del op
        return out
    finally:
        dist.destroy_process_group()


def run_collectives(report: Report, world: int, backend: str, accelerator: str, deadline: Deadline) -> None:
    """Measure on ``world`` fresh processes and add a row per collective and size to ``report``."""
    sizes = SIZES[accelerator]
    check = f"{backend} x{world}"
    # about 2 × sizes × 2 collectives × per-size time, plus start-up (at this machine's pace)
    startup = deadline.expect(STARTUP_SECONDS)
    per_size = min(1.0, max(0.05, (deadline.left - startup) / (len(sizes) * 2 * 2)))
    if deadline.left < startup:
        report.add("collectives", check, SKIPPED, f"budget: {deadline.left:.0f} s left, start-up takes about "
                                                  f"{startup:.0f} s here")
        return
    try:
        ranks = launch(measure, world, args=(backend, accelerator, sizes, per_size),
                       timeout=max(30.0, deadline.left * 2), env={"OMP_NUM_THREADS": "1"},
                       start_method="forkserver", preload=["paratrain"])  # forked: no import of torch per worker
    except LaunchError as e:
        report.add("collectives", check, FAIL, str(e))
        return
    for name in ("all_reduce", "all_gather"):
        for i, nbytes in enumerate(sizes):
            t = max(r[name][i][1] for r in ranks)  # the slowest rank's median
            algbw, busbw = bus_bandwidth(name, nbytes, t, world)
            report.add("collectives", f"{name} {check} {_size(nbytes)}", OK,
                       f"{t * 1e6:.0f} us, algbw {algbw / 1e9:.2f} GB/s, busbw {busbw / 1e9:.2f} GB/s",
                       bytes=nbytes, seconds=t, algbw=algbw, busbw=busbw, world_size=world, backend=backend)


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


