"""Correctness: every strategy and precision this machine supports trains what one process trains.

The world-size invariance that ``paratrain verify`` proves, in miniature: the built-in job (an MLP
on the bundled digits) runs a few fixed-seed optimizer steps under each strategy at world size N,
and its final weights and loss curve are compared with the single-device run at world size 1 in
the same precision. Each run is a launch of fresh processes with a hard time limit, forked from a
server that imported the worker once (as ``bench``'s cells are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .. import precision as _precision
from .. import strategies as _strategies
from ..config import TrainConfig
from ..launch.spawn import LaunchError, launch
from ..verify.compare import compare_runs
from ..verify.diagnose import RunView
from ..verify.worker import run_job
from .budget import Deadline
from .report import FAIL, OK, SKIPPED, Report

__all__ = ["Check", "plan_checks", "run_correctness", "TOLERANCES"]

STEPS = 8
"""Optimizer steps per run: enough for a wrong gradient to show, short enough for the budget."""

TOLERANCES = {"cpu": 1e-5, "cuda": 1e-4}
"""Largest relative divergence per tensor (and of the loss curve) that passes in fp32. A low
precision rounds differently when the batch is split differently: ``LOW_PRECISION_TOLERANCE``."""
LOW_PRECISION_TOLERANCE = 5e-2

RUN_SECONDS = {"cpu": 4.0, "cuda": 8.0}
"""What one run is expected to take, start-up included: a run is not started when less is left."""


@dataclass(frozen=True)
class Check:
    """One run compared with the one-process reference of its precision and accelerator."""

    strategy: str
    precision: str
    world_size: int
    accelerator: str
    """cpu or cuda."""
    skip: str | None = None

    @property
    def label(self) -> str:
        on = "GPU" if self.accelerator == "cuda" else "CPU"
        return f"{self.strategy} x{self.world_size} {self.precision} ({on})"


def _config(strategy: str, precision: str, accelerator: str) -> TrainConfig:
    return TrainConfig().with_overrides({
        "parallel.strategy": strategy, "parallel.precision": precision, "parallel.accelerator": accelerator,
        "log_dir": None, "progress": False, "checkpoint_every": 0, "checkpoint_dir": None, "resume": False,
    })


def _skip_reason(strategy: str, precision: str, world: int, accelerator: str, gpus: int) -> str | None:
    cls = _strategies.resolve(strategy)
    if cls.drives_all_local_devices and gpus < 2:
        return f"needs 2 or more GPUs in one process; {gpus} visible"
    if accelerator == "cuda" and cls.processes != "one" and world > gpus:
        return f"{world} processes need {world} GPUs; {gpus} visible"
    try:
        _config(strategy, precision, accelerator)
    except ValueError as e:
        return str(e).splitlines()[0]
    return None


def plan_checks(strategies: list[str], precisions: list[str], world: int, gpus: int,
                probe: Callable[[str, str], str | None]) -> list[Check]:
    """The runs, most telling first: fp32 for every strategy, then each other precision.

    On a CPU machine every run is over gloo on the CPU. On a GPU machine the runs use the GPUs;
    with fewer GPUs than ``world`` the N-process runs go to the CPU (gloo) and each strategy also
    runs on one GPU (its collectives over nccl at world size 1). ``probe(precision, device)`` says
    why a precision cannot run on a device (None: it can)."""
    reference = _strategies.reference()
    targets: list[tuple[int, str]] = []
    if gpus >= world:
        targets.append((world, "cuda"))
    else:
        targets.append((world, "cpu"))
        if gpus:
            targets.append((1, "cuda"))
    checks = []
    for precision in precisions:
        for world_size, accelerator in targets:
            why_precision = probe(precision, accelerator)
            for strategy in strategies:
                cls = _strategies.resolve(strategy)
                if strategy == reference:
                    continue
                if cls.drives_all_local_devices:  # one process over every local GPU (dp)
                    w = max(gpus, 2)
                elif cls.processes == "one":  # one process, compared at world size 1
                    w = 1
                else:
                    w = world_size
                why = why_precision or _skip_reason(strategy, precision, w, accelerator, gpus)
                checks.append(Check(strategy, precision, w, accelerator, why))
    return checks


def _job(check: Check, strategy: str, data: Any, timeout: float) -> dict[str, Any]:
    cfg = _config(strategy, check.precision, check.accelerator)
    return {"kind": "builtin", "config": cfg, "steps": STEPS, "threads": 1, "data": data, "timeout": timeout}


def _launch(nprocs: int, job: dict[str, Any], timeout: float) -> RunView:
    name = f"{job['config'].parallel.strategy} x{nprocs}"
    try:
        ranks = launch(run_job, nprocs, args=(job,), timeout=timeout, env={"OMP_NUM_THREADS": "1"},
                       start_method="forkserver", preload=["paratrain.verify.worker"])
    except LaunchError as e:
        return RunView.merge(name, nprocs, None, error=str(e))
    return RunView.merge(name, nprocs, ranks)


def run_correctness(report: Report, checks: list[Check], deadline: Deadline, data: Any,
                    progress: Callable[[str], None] = lambda s: None) -> None:
    """Run ``checks`` (each with its reference, run once per precision and accelerator) until the
    deadline, adding one row per check to ``report``."""
    refs: dict[tuple[str, str], RunView] = {}
    for check in checks:
        if check.skip:
            report.add("correctness", check.label, SKIPPED, check.skip)
            continue
        key = (check.precision, check.accelerator)
        cost = RUN_SECONDS[check.accelerator] * (1 if key in refs else 2)
        if not deadline.allows(cost, "correctness"):
            report.add("correctness", check.label, SKIPPED, f"budget: {deadline.left:.0f} s left, a run takes "
                                                            f"about {deadline.expect(cost, 'correctness'):.0f} s here")
            continue
        timeout = max(30.0, 4 * deadline.expect(cost, "correctness"))

        with deadline.part(cost, "correctness"):
            if key not in refs:
                progress(f"reference: single {check.precision} ({check.accelerator})")
                refs[key] = _launch(1, _job(check, _strategies.reference(), data, timeout), timeout)
            ref = refs[key]
            progress(check.label)
            nprocs = 1 if _strategies.resolve(check.strategy).processes == "one" else check.world_size
            run = _launch(nprocs, _job(check, check.strategy, data, timeout), timeout)
        tolerance = _tolerance(check)
        if run.error or ref.error:
            why = run.error or f"the one-process reference failed: {ref.error}"
            report.add("correctness", check.label, FAIL, why, tolerance=tolerance)
            continue
        comparison = compare_runs(check.label, run.state, ref.state, tolerance, run.losses, ref.losses,
                                  ref.noise_gradients())
        worst = comparison.worst
        divergence = max(worst.divergence if worst else 0.0, comparison.loss_divergence or 0.0)
        where = f" ({worst.name})" if worst and worst.divergence >= (comparison.loss_divergence or 0.0) else \
            " (loss curve)"
        text = (f"largest relative divergence from one process {divergence:.1e}{where}, tolerance "
                f"{tolerance:g}, {STEPS} steps")
        report.add("correctness", check.label, OK if comparison.passed else FAIL, text,
                   divergence=divergence, tolerance=tolerance, steps=STEPS)


def _tolerance(check: Check) -> float:
    if not _precision.lookup(check.precision).reference:
        return LOW_PRECISION_TOLERANCE
    return TOLERANCES["cuda" if check.accelerator == "cuda" else "cpu"]
