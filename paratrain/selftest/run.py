"""``run_selftest``: the sections in order, sharing one time budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .. import precision as _precision
from .. import strategies as _strategies
from .budget import Budget
from .report import OK, SKIPPED, Report

__all__ = ["SECTIONS", "SelftestOptions", "run_selftest"]

SECTIONS = ("correctness", "layouts", "collectives", "speed", "lm", "memory", "resnet50", "compile")
"""In the order they run; each takes a share of the time left when it starts (``SHARES``), the last
one run all of it."""
COLLECTIVES_AT_LEAST_S = 15.0  # a backend's collectives need 10 s to start and report (collectives.py), then sizes
SHARES = {"correctness": 0.45, "layouts": 0.3, "collectives": 0.15, "speed": 0.3, "lm": 0.3, "memory": 0.35, "resnet50": 0.75, "compile": 1.0}


@dataclass(kw_only=True)
class SelftestOptions:
    budget: float = 300.0
    """Seconds for the whole run; a part that would not fit is skipped and listed."""
    nproc: int | None = None
    """Processes for the multi-process checks (None: the GPUs when there are 2 or more, else 2)."""
    sections: list[str] = field(default_factory=lambda: list(SECTIONS))
    strategies: list[str] = field(default_factory=lambda: list(_strategies.STRATEGIES))
    precisions: list[str] = field(default_factory=_precision.bench_defaults)

    def __post_init__(self) -> None:
        Budget(self.budget)  # one-line error for a bad budget
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"selftest --nproc-per-node {self.nproc} must be at least 1")
        for name in self.sections:
            if name not in SECTIONS:
                raise ValueError(f"selftest section {name!r} is unknown: use some of {', '.join(SECTIONS)}")
        for name in self.strategies:
            _strategies.resolve(name)
        self.precisions = list(dict.fromkeys(_precision.resolve(p) for p in self.precisions))


def _gpus() -> int:
    from ..bench.matrix import cuda_devices

    return cuda_devices()


def run_selftest(opts: SelftestOptions, progress: Callable[[str], None] | None = None) -> Report:
    """Run the sections of ``opts`` within its budget; the report of what passed, failed and was skipped."""
    from ..bench.matrix import _probe_precision
    from ..config import TrainConfig
    from .facts import compile_probe, device_facts

    say = progress or (lambda s: None)
    budget = Budget(opts.budget)
    report = Report(budget_s=opts.budget)
    gpus = _gpus()
    world = opts.nproc or (gpus if gpus >= 2 else 2)
    accelerator = "cuda" if gpus else "cpu"
    report.facts = device_facts()
    report.facts["processes"] = world
    chosen = [name for name in SECTIONS if name in opts.sections]
    for name in chosen:
        share = 1.0 if name == chosen[-1] else SHARES[name]  # the last section chosen has what is left
        deadline = budget.section(share)
        say(f"{name} ({deadline.left:.0f} s)")
        if name == "correctness":
            from .correctness import plan_checks, run_correctness

            checks = plan_checks(opts.strategies, opts.precisions, world, gpus, _probe_precision)
            run_correctness(report, checks, deadline, TrainConfig().dataset(train=True), say)
        elif name == "layouts":
            from .correctness import plan_layouts, run_correctness

            run_correctness(report, plan_layouts(world, gpus), deadline, TrainConfig().dataset(train=True), say,
                            section="layouts")
        elif name == "collectives":
            from .collectives import run_collectives

            backends = [("nccl", "cuda", min(world, gpus))] if gpus else []
            if not gpus or world > gpus:
                backends.append(("gloo", "cpu", world))
            for i, (backend, device, n) in enumerate(backends):
                # a backend's least time at this machine's pace (its start-up is judged at that pace too)
                least = COLLECTIVES_AT_LEAST_S * budget.pace()
                run_collectives(report, n, backend, device, budget.section(share / (len(backends) - i), at_least=least))
        elif name == "speed":
            from .speed import run_speed

            ddp_world = min(world, gpus) if gpus else world
            if ddp_world < 2 and gpus:
                ddp_world = 1  # one GPU: the loops still run, each with its world-size-1 DDP over nccl
            cfg = TrainConfig().with_overrides({"model": "resnet20" if gpus else "cnn",
                                                "data.dataset": "synthetic" if gpus else "digits"})
            shape = (3, 32, 32) if gpus else (1, 8, 8)
            job = {"data": cfg.dataset(train=True), "input_shape": shape, "num_classes": 10, "model": cfg.model,
                   "global_batch": 256 if gpus else 64}
            run_speed(report, ddp_world, accelerator, deadline, job, steps=100 if gpus else 40)
        elif name == "lm":
            from .lm import run_lm

            run_lm(report, accelerator, deadline)
        elif name == "memory":
            from .speed import run_strategy_cells

            cfg = TrainConfig().with_overrides({"log_dir": None, "progress": False})
            run_strategy_cells(report, cfg, opts.strategies, min(world, gpus) if gpus else world, deadline)
        elif name == "resnet50":
            from .seed import run_seed_table

            run_seed_table(report, world, gpus, deadline, say)
        elif name == "compile":
            if deadline.left < 10:
                report.add("device", "torch.compile", SKIPPED, f"budget: {deadline.left:.0f} s left")
            else:
                works, why = compile_probe(deadline.left)
                report.facts["torch.compile"] = {True: "works", False: "fails", None: "undecided"}[works]
                report.add("device", "torch.compile", {True: OK, False: "FAIL", None: SKIPPED}[works], why)
    report.elapsed_s = budget.elapsed
    return report


