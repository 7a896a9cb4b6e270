"""``paratrain bench --predict``: the inputs of :mod:`~paratrain.bench.predict` measured here.

* the link: median times of gloo all-reduces of a few sizes between 2 local processes (hard time
  limit), fitted by :func:`~paratrain.bench.predict.fit_link`, unless ``--link`` gives one;
* compute: the bench's reference (single-device fp32) step time and batch;
* the exposed fraction: ``(t_ddp2 − t_single/2) / t_comm(2)`` from the bench's 2-worker ``ddp``
  cell (each of its workers computes half the batch), clipped to 0–1, unless ``--exposed`` gives it;
* on this host (the link fitted here, the cells on the CPU): one worker's compute measured with N
  processes running it at once, which is what N processes on one host's cores pay
  (:func:`concurrent_compute`), and the ddp cells that ran, predicted against measured (:func:`on_this_host`).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..env.network import free_port
from ..precision import reference as reference_precision
from ..strategies import data_parallel_reference
from .matrix import cuda_devices
from .predict import Link, Nodes, Prediction, Workload, fit_link, format_predictions, predict, scheme_comm_s
from .runner import BenchResult, reference

__all__ = ["measure_all_reduce", "measured_link", "exposed_fraction", "concurrent_compute", "on_this_host",
           "predict_from_bench"]

SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)
"""Bytes per measured all-reduce: 4 KiB to 16 MiB."""


def _all_reduce_worker(rank: int, port: int, sizes: tuple[int, ...], repeats: int, out: Any, world: int = 2) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = []
        for nbytes in sizes:
            t = torch.ones(nbytes // 4)
            times = []
            for i in range(repeats + 2):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                if i >= 2:  # the first two warm up gloo's buffers
                    times.append(time.perf_counter() - t0)
            result.append((float(nbytes), statistics.median(times)))
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def measure_all_reduce(sizes: tuple[int, ...] = SIZES, repeats: int = 15,
                       timeout: float = 120.0, world: int = 2) -> list[tuple[float, float]]:
    """``(bytes, median seconds)`` of gloo all-reduces between ``world`` processes on this machine."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_all_reduce_worker, args=(r, port, sizes, repeats, out, world), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=timeout)  # type: ignore[no-any-return]
    except Exception:
        raise RuntimeError(f"the gloo all-reduce measurement did not finish in {timeout:.0f} s: pass --link") from None
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def measured_link(samples: list[tuple[float, float]] | None = None) -> Link:
    """The link fitted to ``samples`` of :func:`measure_all_reduce` (measured now when None)."""
    return fit_link(measure_all_reduce() if samples is None else samples, 2, "fitted to gloo all-reduces of 4 KiB–16 MiB between 2 local processes")


def _compute_worker(rank: int, cfg: TrainConfig, batch: int, steps: int) -> float:
    """One of N processes that each run one worker's step (forward, cross-entropy, backward, SGD) at once,
    with no collective inside a step: its median step in seconds, timed between barriers so the N run together."""
    from ..launch.forkserver import apply_omp_threads

    apply_omp_threads()  # torch was imported by the forkserver, before OMP_NUM_THREADS was set
    dist.init_process_group("gloo")
    try:
        model = cfg.build_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data: Any = cfg.dataset()
        samples = [data[i % len(data)] for i in range(batch)]
        x = torch.stack([torch.as_tensor(s[0]) for s in samples])
        y = torch.as_tensor([int(s[1]) for s in samples])
        times = []
        dist.barrier()
        for i in range(steps + 2):  # two to warm up
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        dist.barrier()
        return statistics.median(times)
    finally:
        dist.destroy_process_group()


def concurrent_compute(cfg: TrainConfig, runs: list[tuple[int, int]], threads: int, steps: int = 10,
                       timeout: float = 120.0) -> dict[tuple[int, int], float]:
    """One worker's step on this host's CPU with N processes running it at once, for each ``(N, batch per
    worker)`` of ``runs`` (``threads`` intra-op threads each, as bench's cells): ``{(N, batch): median seconds
    of the slowest process}``."""
    from ..launch.spawn import launch

    return {(n, b): max(launch(_compute_worker, n, args=(cfg, b, steps), timeout=timeout,
                               env={"OMP_NUM_THREADS": str(threads)}, start_method="forkserver",
                               preload=["torch"]))
            for n, b in runs}


def _ddp_cells(result: BenchResult) -> list[Any]:
    """The bench's plain ddp cells (fp32, no comm hook) that ran, one per world size."""
    return [r for r in result.results if r.status == "ok" and r.step_time_s and r.cell.group == "matrix"
            and r.cell.strategy == data_parallel_reference() and r.cell.precision == reference_precision()
            and r.cell.comm_hook == "none" and r.cell.micro_batches == 1]


def on_this_host(result: BenchResult, cfg: TrainConfig, shapes: tuple[tuple[int, ...], ...], link: Link, threads: int,
                 timeout: float = 120.0) -> str:
    """The bench's ddp cells, which ran as N processes on this host's CPU over loopback gloo, predicted and
    measured: one worker's compute at its batch with N processes at once (:func:`concurrent_compute`, scaled
    to the single cell's step by the same measurement of one process at the whole batch) plus all of the
    gradients' (``shapes``) all-reduce over ``link``."""
    ref = reference(result.results)
    cells = sorted((r for r in _ddp_cells(result) if r.cell.world_size > 1), key=lambda r: r.cell.world_size)
    if ref is None or not ref.step_time_s or not cells:
        return ""
    runs = [(1, ref.cell.global_batch)] + [(r.cell.world_size, r.cell.global_batch // r.cell.world_size) for r in cells]
    try:
        measured = concurrent_compute(cfg, runs, threads, timeout=timeout)
    except Exception as e:  # the table above stands without it
        return f"on this host: not predicted ({type(e).__name__}: {e})"
    scale = ref.step_time_s / measured[runs[0]]  # bench's step (loader, optimizer) against the bare one
    lines = ["on this host (the ddp cells ran as N processes here, over loopback gloo; one worker's compute measured "
             "with N at once, all communication exposed):",
             f"{'workers':>7} | {'batch/worker':>12} | {'compute':>9} | {'predicted':>9} | {'measured':>9} | error"]
    for r, run in zip(cells, runs[1:]):
        n, b = run
        compute = measured[run] * scale
        (p,) = predict(Workload(compute, b, shapes, 1.0), link, ["all-reduce (ddp)"], [n])
        error = (p.step_s - r.step_time_s) / r.step_time_s
        lines.append(f"{n:>7} | {b:>12} | {compute * 1e3:>6.1f} ms | {p.step_s * 1e3:>6.1f} ms | "
                     f"{r.step_time_s * 1e3:>6.1f} ms | {error:+.0%}")
    return "\n".join(lines)


def exposed_fraction(result: BenchResult, w: Workload, link: Link) -> float | None:
    """The fraction of the 2-worker ddp cell's communication that its step time shows, or None."""
    ref = reference(result.results)
    ddp2 = next((r for r in result.results if r.status == "ok" and r.cell.strategy == data_parallel_reference()
                 and r.cell.world_size == 2 and r.cell.precision == reference_precision() and r.cell.comm_hook == "none"
                 and r.cell.group == "matrix"), None)
    if ref is None or ddp2 is None or not ref.step_time_s or not ddp2.step_time_s:
        return None
    comm = scheme_comm_s("all-reduce (ddp)", w, 2, link)
    if comm < 0.05 * ddp2.step_time_s:  # within the noise of one run: no overlap to read off
        return None
    return min(1.0, max(0.0, (ddp2.step_time_s - ref.step_time_s / 2) / comm))


def predict_from_bench(result: BenchResult, cfg: TrainConfig, link_text: str | None, exposed: float | None,
                       out_dir: str, workers_per_node: int = 1, node_link: str | None = None) -> str:
    """The prediction table for the bench's job (and predict.png in ``out_dir`` with matplotlib);
    with ``workers_per_node`` > 1, ``link_text`` is the network between nodes and ``node_link`` the
    link inside one."""
    ref = reference(result.results)
    if ref is None or not ref.step_time_s:
        return "--predict: no single-device cell ran, so there is no compute time to scale"
    model = cfg.build_model()
    shapes = tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)
    link = Link.parse(link_text) if link_text else measured_link()
    w = Workload(ref.step_time_s, ref.cell.global_batch, shapes, 1.0, cfg.parallel.ddp.powersgd_rank)
    how = "given"
    if exposed is None:
        exposed, how = exposed_fraction(result, w, link), "measured from the 2-worker ddp cell"
        if exposed is None:
            exposed, how = 1.0, ("assumed (no 2-worker ddp cell ran, or its communication is under 5% of its "
                                 "step, too little to read the overlap from; --exposed sets it)")
    w = Workload(w.compute_s, w.batch_per_worker, shapes, exposed, w.powersgd_rank)
    nodes = Nodes(workers_per_node, Link.parse(node_link, "--node-link")) if node_link else None
    preds = predict(w, link, nodes=nodes)
    text = format_predictions(w, link, preds, nodes) + f"\nexposed fraction {exposed:.2f}: {how}"
    if link_text is None and not cuda_devices(cfg.parallel.accelerator):  # the cells ran here, on the CPU
        here = on_this_host(result, cfg, shapes, link, int(result.meta.get("spec", {}).get("threads", 1)))
        text += f"\n{here}" if here else ""
    chart = os.path.join(out_dir, "predict.png")
    if write_prediction_chart(preds, chart, f"{cfg.model}: {link.describe()}"):
        text += f"\nwrote {chart}"
    else:
        text += "\nno predict.png: pip install matplotlib"
    return text


def write_prediction_chart(preds: list[Prediction], path: str, title: str) -> bool:
    """Scaling efficiency against workers per scheme; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme in dict.fromkeys(p.scheme for p in preds):
        rows = [p for p in preds if p.scheme == scheme]
        ax.plot([p.workers for p in rows], [100 * p.efficiency for p in rows], marker="o", label=scheme)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("predicted scaling efficiency %")
    ax.set_ylim(0, 105)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    with open(path, "wb") as f:
        f.write(png.getvalue())
    plt.close(fig)
    return True
