"""Speed: paratrain's ``ddp`` against the hand-written DDP loop (and Accelerate's and Lightning
Fabric's, where they import), interleaved in the same processes as ``bench``'s overhead row
measures it; then each strategy's step time and peak memory, from ``bench`` cells.

The loops are generators over optimizer steps (:mod:`paratrain.bench.overhead`): the same model and
initial weights, data, per-worker batch, SGD and loss. :func:`~paratrain.bench.overhead.interleave`
steps them in blocks, ABBA, so other load on the machine hits every loop alike.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import statistics
import warnings
from typing import Any, Callable, Generator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ..launch.spawn import LaunchError, launch
from .budget import Deadline
from .report import FAIL, OK, SKIPPED, Report

__all__ = ["FRAMEWORKS", "accelerate_steps", "fabric_steps", "speed_worker", "run_speed"]

FABRIC_DDP = "ddp"
"""Lightning Fabric's name for its DistributedDataParallel strategy (Lightning's, not paratrain's)."""

FRAMEWORKS = {"accelerate": "accelerate", "lightning": "lightning"}
"""The other loops' names and the module each needs."""

SPEED_SECONDS = 15.0
"""What the interleaved loops take on a CPU, start-up included: they are not started when less is left."""
MEMORY_CELL_SECONDS = 5.0
"""What one strategy's step-time and memory cell takes, start-up included."""


def accelerate_steps(net: nn.Module, trainset: Any, batch_size: int, device: torch.device, lr: float = 0.001,
                     momentum: float = 0.9) -> Generator[Any, None, None]:
    """The loop as Accelerate's documentation writes it (``prepare``, ``accelerator.backward``)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=device.type == "cpu")
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    loader = DataLoader(trainset, batch_size=batch_size, shuffle=True, drop_last=True)
    net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    return _steps(net, optimizer, loader, accelerator.backward)


def fabric_steps(net: nn.Module, trainset: Any, batch_size: int, device: torch.device, world: int,
                 lr: float = 0.001, momentum: float = 0.9) -> Generator[Any, None, None]:
    """The loop as Lightning Fabric's documentation writes it (``setup``, ``fabric.backward``)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu", devices=world, strategy=FABRIC_DDP)
    fabric.launch()  # the processes exist already: it joins their group
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    net, optimizer = fabric.setup(net, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(trainset, batch_size=batch_size, shuffle=True, drop_last=True))
    return _steps(net, optimizer, loader, fabric.backward)


def _steps(net: nn.Module, optimizer: Any, loader: Any, backward: Callable[[torch.Tensor], None]
           ) -> Generator[Any, None, None]:
    """The framework's set-up loop as a generator: the first ``next()`` yields the model, each later
    one runs one step (``backward`` is the framework's) and yields its loss."""
    criterion = nn.CrossEntropyLoss()
    yield net
    while True:
        for images, labels in loader:
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            backward(loss)
            optimizer.step()
            yield loss.detach()


def speed_worker(local_rank: int, job: dict[str, Any]) -> dict[str, Any]:
    """In each launched process: build every loop, interleave them, return this rank's step times."""
    from ..bench.baseline import plain_ddp_steps
    from ..bench.overhead import interleave, parallel_steps
    from ..config import ParallelConfig
    from ..env.devices import select_device
    from ..models import build_model
    from ..parallel import Parallel
    from ..strategies import data_parallel_reference

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    accelerator = job["accelerator"]
    device = select_device(local_rank, accelerator)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    loops: dict[str, Any] = {}
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            world = dist.get_world_size()
            per_worker = job["global_batch"] // world
            trainset, shape, classes = job["data"], job["input_shape"], job["num_classes"]

            def model() -> nn.Module:
                torch.manual_seed(0)  # every loop starts from the same weights
                return build_model(job["model"], shape, classes)

            loops["hand-written"] = plain_ddp_steps(model().to(device), trainset, per_worker, device=device)
            plain = data_parallel_reference()  # paratrain's DDP
            pt = Parallel(ParallelConfig(strategy=plain, global_batch=per_worker * world, accelerator=accelerator))
            net = model()
            loops["paratrain"] = parallel_steps(pt, net, torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9),
                                                trainset)
            if "accelerate" in job["frameworks"]:
                loops["accelerate"] = accelerate_steps(model().to(device), trainset, per_worker, device)
            if "lightning" in job["frameworks"]:
                loops["lightning"] = fabric_steps(model(), trainset, per_worker, device, world)
            for loop in loops.values():
                next(loop)  # set up
            sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
            timed = interleave(loops, job["steps"], job["block"], job["warmup"], first="hand-written", sync=sync)
        return {"rank": dist.get_rank(), "wall": timed["wall"]}
    finally:
        for loop in loops.values():
            loop.close()
        loops.clear()
        dist.barrier()
        dist.destroy_process_group()


def run_speed(report: Report, world: int, accelerator: str, deadline: Deadline, job_data: dict[str, Any],
              steps: int) -> None:
    """The overhead rows: paratrain, Accelerate and Lightning against the hand-written loop."""
    frameworks = []
    for name, module in FRAMEWORKS.items():
        if importlib.util.find_spec(module) is None:
            report.add("speed", f"{name} ddp x{world}", SKIPPED, f"{module} is not installed (pip install {module})")
        else:
            frameworks.append(name)
    if not deadline.allows(SPEED_SECONDS, "speed"):
        report.add("speed", f"overhead ddp x{world}", SKIPPED, f"budget: {deadline.left:.0f} s left, the loops "
                                                               f"take about {deadline.expect(SPEED_SECONDS, 'speed'):.0f} s here")
        return
    job = {**job_data, "accelerator": accelerator, "frameworks": frameworks, "steps": steps, "block": 5,
           "warmup": 3}
    # A timing row proves nothing about correctness: a launch that fails (a port taken between
    # picking and binding it, a worker that dies) gets one more try while the budget allows it.
    errors: list[str] = []
    ranks: list[Any] | None = None
    while ranks is None and len(errors) < 2 and (not errors or deadline.allows(SPEED_SECONDS, "speed")):
        try:
            with deadline.part(SPEED_SECONDS, "speed"):
                ranks = launch(speed_worker, world, args=(job,), timeout=max(60.0, deadline.left * 2),
                               env={"OMP_NUM_THREADS": "1"}, start_method="forkserver", preload=["paratrain"])
        except LaunchError as e:
            errors.append(str(e))
    if ranks is None:
        report.add("speed", f"overhead ddp x{world}", FAIL, "; then ".join(errors))
        return
    retried = f"; second try, the first failed: {errors[0]}" if errors else ""
    from ..bench.overhead import Overhead

    def slowest(variant: str) -> list[list[float]]:  # a step is as slow as its slowest rank
        per_rank = [r["wall"][variant] for r in ranks]
        return [[max(step) for step in zip(*blocks)] for blocks in zip(*per_rank)]

    plain = slowest("hand-written")
    median = statistics.median([s for block in plain for s in block])
    report.add("speed", f"hand-written DDP x{world}", OK, f"median step {median * 1e3:.2f} ms "
               f"({job['model']}, global batch {job['global_batch']}){retried}", step_s=median)
    for variant in ["paratrain", *frameworks]:
        over = Overhead.from_rounds(slowest(variant), plain, subject=variant)
        name = "paratrain ddp" if variant == "paratrain" else f"{variant} ddp"
        report.add("speed", f"{name} x{world}", OK, f"{over.describe()} of the hand-written step",
                   ratio=over.ratio, rounds=over.rounds)


def run_strategy_cells(report: Report, cfg: Any, strategies: list[str], world: int, deadline: Deadline) -> None:
    """Each strategy's step time and peak memory per rank: one ``bench`` cell each, fp32."""
    from ..bench.matrix import BenchSpec, build_matrix
    from ..bench.runner import _job_data, run_cells

    spec = BenchSpec(strategies=strategies, world_sizes=sorted({1, world}), precisions=["32"], comm_hooks=["none"],
                     epochs=1, warmup_steps=2, baseline=False, trap=False, nccl_cells=False,
                     cell_timeout=max(30.0, deadline.left))
    data = _job_data(cfg)
    train_size = len(data[0] if data is not None else cfg.dataset(train=True))
    cells = build_matrix(spec, cfg, train_size)
    for cell in cells:
        if cell.skip:
            report.add("memory", cell.label, SKIPPED, cell.skip)
            continue
        if not deadline.allows(MEMORY_CELL_SECONDS, "memory"):
            report.add("memory", cell.label, SKIPPED, f"budget: {deadline.left:.0f} s left, a cell takes about "
                                                      f"{deadline.expect(MEMORY_CELL_SECONDS, 'memory'):.0f} s here")
            continue
        with deadline.part(MEMORY_CELL_SECONDS, "memory"):
            (r,) = run_cells([cell], spec, cfg, data, progress=False)
        if r.status != "ok":
            report.add("memory", cell.label, FAIL if r.status == "failed" else SKIPPED, r.reason or r.status)
            continue
        peak = "n/a" if r.peak_mem_mib is None else f"{r.peak_mem_mib:.0f} MiB"
        step = "" if r.step_time_s is None else f", step {r.step_time_s * 1e3:.1f} ms"
        report.add("memory", cell.label, OK, f"peak {peak} per rank ({r.mem_method}){step}",
                   peak_mem_mib=r.peak_mem_mib, step_s=r.step_time_s, method=r.mem_method)
