"""One bench cell inside one worker process: train, time the steps after warm-up, evaluate.

:func:`run_cell` is what :func:`paratrain.launch` starts in every process of a cell. A paratrain
cell runs the built-in job's own pieces (``Parallel``, ``fit``) with the cell's config; the
``plain-ddp`` cell runs the hand-written loop of :mod:`paratrain.bench.baseline` instead.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import math
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..data.augment import augment_for, eval_augment_for
from ..data.datasets import dataset_info
from ..env.devices import select_device
from ..env.process import destroy, preload_dynamo
from ..models import build_model
from ..strategies.base import NotApplicable
from .matrix import BASELINE, Cell
from .measure import CommCounter, PeakMemory, ddp_bucket_bytes, sync

__all__ = ["run_cell", "cell_config"]


def cell_config(base: TrainConfig, cell: Cell, epochs: int) -> TrainConfig:
    """The :class:`TrainConfig` a cell trains: the base config with the cell's settings, no files."""
    return base.with_overrides({**cell.overrides(), "epochs": epochs, "max_steps": None, "log_dir": None,
                                "progress": False, "checkpoint_every": 0, "checkpoint_dir": None, "resume": False})


class _Clock:
    """Step times from the end of optimizer step ``start`` to the end of step ``stop``.

    On CPU every step is timed and the median is used, which a burst of other load on a shared
    machine barely moves; on CUDA the device is synchronised only at both ends and the mean is used.
    """

    def __init__(self, device: torch.device, start: int, stop: int, memory: PeakMemory) -> None:
        self.device, self.start, self.stop, self.memory = device, start, stop, memory
        self.t0 = self.t1 = self.last = 0.0
        self.durations: list[float] = []
        self.timing = False
        self.peak = 0

    def on_step(self, step: int) -> None:
        now = time.perf_counter()
        if self.timing:
            self.durations.append(now - self.last)
            self.last = now
        if step == self.start:
            sync(self.device)
            self.memory.reset()
            self.t0 = self.last = time.perf_counter()
            self.timing = True
        if step == self.stop and self.timing:
            sync(self.device)
            self.t1, self.timing = time.perf_counter(), False
            self.peak = self.memory.read()

    def summary(self) -> dict[str, Any]:
        window = self.t1 - self.t0
        mean = window / max(len(self.durations), 1)
        median = statistics.median(self.durations) if self.durations else math.nan
        return {"timed_s": window, "step_mean_s": mean,
                "step_time_s": mean if self.device.type == "cuda" else median,
                "timing": "mean (synchronised window)" if self.device.type == "cuda" else "median step"}


def _datasets(cfg: TrainConfig, data: Any) -> tuple[Any, Any]:
    if data is not None:  # built once by the parent (small data sets): no per-process loading cost
        return data
    return cfg.dataset(train=True), cfg.dataset(train=False)


def run_cell(local_rank: int, job: dict[str, Any]) -> dict[str, Any]:
    """Train ``job["cell"]`` on this process's share; return this rank's measurements."""
    torch.set_num_threads(job["threads"])
    faulthandler.dump_traceback_later(max(1.0, job["timeout"] - 5))  # a hang shows where, before the kill
    # The table is the output: the workers' own prints and warnings (layout lines, deprecations) are not.
    warnings.simplefilter("ignore")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            cell: Cell = job["cell"]
            cfg: TrainConfig = job["config"]  # cell_config, built and validated by the runner
            train_set, test_set = _datasets(cfg, job.get("data"))
            if cell.strategy == BASELINE:
                return _run_baseline(local_rank, cfg, cell, job, train_set, test_set)
            return _run_paratrain(cfg, job, train_set, test_set)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _run_paratrain(cfg: TrainConfig, job: dict[str, Any], train_set: Any, test_set: Any) -> dict[str, Any]:
    from ..parallel import Parallel

    counter = CommCounter().install()
    pt = Parallel(cfg.parallel)
    try:
        result = _train_paratrain(pt, counter, cfg, job, train_set, test_set)
    except NotApplicable as e:  # the strategy cannot run this model (no Linear pair, not sequential...) on every rank
        result = {"status": "skipped", "reason": str(e).splitlines()[0]}
    except ValueError as e:  # a mistake in the job (the user's model or data): the cell failed, say why
        result = {"status": "failed", "reason": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    except BaseException:
        counter.uninstall()
        pt.close(wait_for_peers=False)  # peers may be gone: no barrier
        raise
    counter.uninstall()
    pt.close()
    return result


def _train_paratrain(pt: Any, counter: CommCounter, cfg: TrainConfig, job: dict[str, Any], train_set: Any,
                     test_set: Any) -> dict[str, Any]:
    from ..loop.fit import fit
    from ..loop.train import setup_task

    steps_per_epoch = pt.steps_per_epoch(train_set)
    total = cfg.epochs * steps_per_epoch
    model, optimizer, scheduler = setup_task(pt, cfg, total)  # the schedule spans the cell's run
    warm = min(job["warmup_steps"], total - 1)
    clock = _Clock(pt.device, warm, total, PeakMemory(pt.device))
    clock.on_step(0)  # warm == 0: time from the first step on

    # Count communication inside training steps only (forward + backward), never in metrics.
    inner = pt.training_step

    def training_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        with counter.step(count=clock.timing):
            return inner(*args, **kwargs)

    pt.training_step = training_step  # type: ignore[method-assign]
    aug = eval_augment_for(cfg.data.dataset)
    result = fit(pt, model, optimizer, train_set, epochs=cfg.epochs, scheduler=scheduler,
                 augment=augment_for(cfg.data.dataset) if cfg.data.augment else None,
                 log_every=steps_per_epoch, progress_bar=False, on_step=lambda p: clock.on_step(p.global_step))
    evaluation = pt.evaluate(model, pt.eval_loader(test_set, transform=None if aug is None else (lambda x: aug(x, 0))))
    timed_steps = total - warm
    # What the counter cannot see: DDP's C++ all-reduce without a hook, ps's RPC push + pull in optimizer.step
    hidden = pt.hidden_comm_bytes_per_step(model) * timed_steps
    comm = counter.bytes + hidden
    by_dim = counter.by_dimension(pt.comm_dimensions, hidden)
    return {
        "status": "ok", "rank": pt.rank, "device": str(pt.device), "threads": torch.get_num_threads(),
        "steps": result.steps, "steps_per_epoch": steps_per_epoch, "timed_steps": timed_steps,
        **clock.summary(), "global_batch": pt.global_batch,
        "final_loss": result.train_loss, "test_loss": evaluation["loss"],
        "test_accuracy": evaluation["accuracy"], "skipped_steps": result.skipped_steps,
        "peak_mem_bytes": clock.peak, "mem_method": clock.memory.method,
        "comm_bytes_per_step": comm / max(timed_steps, 1),
        "comm_by_dimension": {d: b / max(timed_steps, 1) for d, b in by_dim.items()},
        "lr": optimizer.param_groups[0]["lr"],
    }


def _run_baseline(local_rank: int, cfg: TrainConfig, cell: Cell, job: dict[str, Any], train_set: Any,
                  test_set: Any) -> dict[str, Any]:
    """The hand-written loop, and in the same processes the same loop through paratrain's ``ddp``,
    interleaved block by block (:mod:`paratrain.bench.overhead`): the row is the hand-written
    loop's, and the per-round ratios are the overhead line's. No paratrain in the hand-written path."""
    from ..loop.train import build_optimizer
    from ..parallel import Parallel
    from .baseline import plain_ddp_steps
    from .overhead import interleave, parallel_steps

    device = select_device(local_rank, cfg.parallel.accelerator)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    preload_dynamo()

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        world = dist.get_world_size()
        info = dataset_info(cfg.data.dataset, cfg.data.data_dir)
        shape, classes = tuple(info["input_shape"]), info["num_classes"]
        torch.manual_seed(cfg.parallel.seed)  # same initial weights as paratrain's cells
        net = build_model(cfg.model, shape, classes).to(device)
        per_worker = cell.global_batch // world
        steps = plain_ddp_steps(net, train_set, per_worker, seed=cfg.parallel.seed, device=device,
                                make_optimizer=lambda m: build_optimizer(m.parameters(), cfg))
        ddp = next(steps)  # setup
        pt = Parallel(cfg.parallel)  # joins the group above
        torch.manual_seed(cfg.parallel.seed)
        twin = build_model(cfg.model, shape, classes)
        ours = parallel_steps(pt, twin, build_optimizer(twin.parameters(), cfg), train_set)
        next(ours)
        steps_per_epoch = math.ceil(len(train_set) / world) // per_worker  # DistributedSampler pads shards
        total = cfg.epochs * steps_per_epoch
        warm = min(job["warmup_steps"], total - 1)
        memory = PeakMemory(device)  # its method only: see peak_mem_bytes below
        timed = interleave({"plain": steps, "paratrain": ours}, total - warm, job.get("overhead_block", 4), warm,
                           sync=(lambda: sync(device)) if device.type == "cuda" else None)
        plain_s = [s for block in timed["wall"]["plain"] for s in block]
        last_epoch = timed["outputs"]["plain"][-steps_per_epoch:]
        bucket = ddp_bucket_bytes(ddp)  # the built-in C++ all-reduce: all buckets once per step
        steps.close()
        ours.close()
        final = torch.stack(last_epoch).mean()
        dist.all_reduce(final)
        accuracy, test_loss = _plain_evaluate(net, test_set, device) if dist.get_rank() == 0 else (None, None)
        result = {
            "status": "ok", "rank": dist.get_rank(), "device": str(device), "threads": torch.get_num_threads(),
            "steps": total, "steps_per_epoch": steps_per_epoch, "timed_steps": total - warm,
            "timed_s": sum(plain_s), "step_mean_s": statistics.fmean(plain_s),
            "step_time_s": statistics.fmean(plain_s) if device.type == "cuda" else statistics.median(plain_s),
            "global_batch": per_worker * world,
            "final_loss": final.item() / world, "test_loss": test_loss, "test_accuracy": accuracy,
            # these processes also hold the paratrain twin's model, optimizer and buckets: no peak to compare
            "skipped_steps": 0, "peak_mem_bytes": None, "mem_method": memory.method,
            "comm_bytes_per_step": float(bucket), "lr": cfg.optim.lr,
            "overhead": {k: timed[k] for k in ("wall", "cpu")},
        }
    except BaseException:
        destroy(wait_for_peers=False)  # peers may be gone: no barrier
        raise
    del ddp, steps, net, ours, twin  # free the DDP reducers while the group is alive
    destroy(wait_for_peers=True)  # a barrier first: see paratrain.env.process.destroy
    return result


@torch.no_grad()
def _plain_evaluate(net: torch.nn.Module, test_set: Any, device: torch.device) -> tuple[float, float]:
    """Rank 0 evaluates the whole test set, as a hand-written script does."""
    net.eval()
    correct = total = 0
    loss = 0.0
    for x, y in torch.utils.data.DataLoader(test_set, batch_size=256):
        out = net(x.to(device))
        y = y.to(device)
        loss += torch.nn.functional.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        total += len(y)
    return correct / total, loss / total
