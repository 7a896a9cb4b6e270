"""Correctness: every strategy, precision and layout this machine supports trains what one process trains.

The world-size invariance that ``paratrain verify`` proves, in miniature: the built-in job (an MLP
on the bundled digits) runs a few fixed-seed optimizer steps under each strategy at world size N,
and its final weights and loss curve are compared with the single-device run at world size 1 in
the same precision. The layouts (``plan_layouts``: each set of two mesh dimensions the world size
makes, and of three from 8 processes) do the same on the built-in transformer, which has blocks
to pipeline and heads to split. Each run is a launch of fresh processes with a hard time limit,
forked from a server that imported the worker once (as ``bench``'s cells are).
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

__all__ = ["Check", "plan_checks", "plan_layouts", "run_correctness", "TOLERANCES"]

STEPS = 8
"""Optimizer steps per run: enough for a wrong gradient to show, short enough for the budget."""

TOLERANCES = {"cpu": 1e-5, "cuda": 1e-4}
"""Largest relative divergence per tensor (and of the loss curve) that passes in fp32. A low
precision rounds differently when the batch is split differently: ``LOW_PRECISION_TOLERANCE``."""
LOW_PRECISION_TOLERANCE = 5e-2

RUN_SECONDS = {"cpu": 4.0, "cuda": 8.0}
"""What one run is expected to take, start-up included: a run is not started when less is left."""
LAYOUT_COST = 2.0
"""A layout's run against a strategy's: more processes, and a transformer instead of an MLP."""


@dataclass(frozen=True)
class Check:
    """One run compared with the one-process reference of its precision and accelerator."""

    strategy: str
    precision: str
    world_size: int
    accelerator: str
    """cpu or cuda."""
    skip: str | None = None
    mesh: str | None = None
    """A layout (``"pp=2,tp=2"``) run by the mesh strategy on :data:`LAYOUT_MODEL`; None: ``strategy``'s shorthand."""

    @property
    def label(self) -> str:
        on = "GPU" if self.accelerator == "cuda" else "CPU"
        return f"{self.mesh or self.strategy} x{self.world_size} {self.precision} ({on})"

    @property
    def model(self) -> str | None:
        """The built-in model a layout trains (None: the config's default)."""
        return LAYOUT_MODEL if self.mesh else None


LAYOUT_MODEL = "transformer"
"""The layouts' model: :class:`~paratrain.models.TinyTransformer` has 2 blocks (``pp`` up to 2) and 2 heads (``tp`` up to 2)."""
LAYOUT_MOST = {"pp": 2, "tp": 2}


def _config(strategy: str, precision: str, accelerator: str, mesh: str | None = None) -> TrainConfig:
    overrides: dict[str, Any] = {
        "parallel.strategy": strategy, "parallel.precision": precision, "parallel.accelerator": accelerator,
        "log_dir": None, "progress": False, "checkpoint_every": 0, "checkpoint_dir": None, "resume": False,
    }
    if mesh:
        overrides.update({"parallel.strategy": "auto", "parallel.mesh": mesh, "model": LAYOUT_MODEL})
    return TrainConfig().with_overrides(overrides)


def _skip_reason(strategy: str, precision: str, world: int, accelerator: str, gpus: int,
                 mesh: str | None = None) -> str | None:
    cls = _strategies.resolve(strategy)
    if cls.drives_all_local_devices and gpus < 2:
        return f"needs 2 or more GPUs in one process; {gpus} visible"
    if accelerator == "cuda" and cls.processes != "one" and world > gpus:
        return f"{world} processes need {world} GPUs; {gpus} visible"
    try:
        _config(strategy, precision, accelerator, mesh)
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


def plan_layouts(world: int, gpus: int, precision: str | None = None) -> list[Check]:
    """One layout for each set of two mesh dimensions that ``world`` processes make (and of three from 8),
    its sizes as even as :data:`LAYOUT_MODEL` allows; a row that says why when there is none. ``precision``:
    the reference one by default."""
    from ..bench.layouts import candidate_layouts
    from ..strategies.mesh import describe

    precision = precision or _precision.reference()
    accelerator = "cuda" if gpus >= world else "cpu"
    chosen: dict[tuple[str, ...], dict[str, int]] = {}
    for sizes in candidate_layouts(world, world, LAYOUT_MOST["pp"]):
        dims = tuple(d for d, n in sizes.items() if n > 1)
        if len(dims) < 2 or len(dims) > (3 if world >= 8 else 2) or sizes["tp"] > LAYOUT_MOST["tp"]:
            continue
        if dims not in chosen or max(sizes.values()) < max(chosen[dims].values()):
            chosen[dims] = sizes
    if not chosen:
        why = (f"a layout of two dimensions needs 4 processes or more, this run has {world}: "
               "run selftest --nproc-per-node 4 (8 for three)")
        return [Check("mesh", precision, world, accelerator, why, mesh="2-D layouts")]
    ordered = sorted(chosen.values(), key=lambda sizes: -sum(n > 1 for n in sizes.values()))  # 3-D first
    return [Check("mesh", precision, world, accelerator,
                  _skip_reason("mesh", precision, world, accelerator, gpus, describe(sizes)), mesh=describe(sizes))
            for sizes in ordered]


def _job(check: Check, strategy: str, data: Any, timeout: float) -> dict[str, Any]:
    cfg = _config(strategy, check.precision, check.accelerator, check.mesh if strategy == check.strategy else None)
    if check.model:
        cfg = cfg.with_overrides({"model": check.model})
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
                    progress: Callable[[str], None] = lambda s: None, section: str = "correctness") -> None:
    """Run ``checks`` (each with its reference, run once per precision, accelerator and model) until
    the deadline, adding one row per check to ``report`` under ``section``."""
    refs: dict[tuple[str, str, str | None], RunView] = {}
    for check in checks:
        if check.skip:
            report.add(section, check.label, SKIPPED, check.skip)
            continue
        key = (check.precision, check.accelerator, check.model)
        cost = RUN_SECONDS[check.accelerator] * (1 if key in refs else 2)
        if check.mesh:
            cost *= LAYOUT_COST
        if not deadline.allows(cost, section):
            report.add(section, check.label, SKIPPED, f"budget: {deadline.left:.0f} s left, a run takes "
                                                            f"about {deadline.expect(cost, section):.0f} s here")
            continue
        timeout = max(30.0, 4 * deadline.expect(cost, section))

        with deadline.part(cost, section):
            if key not in refs:
                progress(f"reference: single {check.precision} ({check.accelerator}{', ' + check.model if check.model else ''})")
                refs[key] = _launch(1, _job(check, _strategies.reference(), data, timeout), timeout)
            ref = refs[key]
            progress(check.label)
            nprocs = 1 if _strategies.resolve(check.strategy).processes == "one" else check.world_size
            run = _launch(nprocs, _job(check, check.strategy, data, timeout), timeout)
        tolerance = _tolerance(check)
        if run.error or ref.error:
            why = run.error or f"the one-process reference failed: {ref.error}"
            report.add(section, check.label, FAIL, why, tolerance=tolerance)
            continue
        comparison = compare_runs(check.label, run.state, ref.state, tolerance, run.losses, ref.losses,
                                  ref.noise_gradients())
        worst = comparison.worst
        divergence = max(worst.divergence if worst else 0.0, comparison.loss_divergence or 0.0)
        where = f" ({worst.name})" if worst and worst.divergence >= (comparison.loss_divergence or 0.0) else \
            " (loss curve)"
        text = (f"largest relative divergence from one process {divergence:.1e}{where}, tolerance "
                f"{tolerance:g}, {STEPS} steps")
        report.add(section, check.label, OK if comparison.passed else FAIL, text,
                   divergence=divergence, tolerance=tolerance, steps=STEPS)


def _tolerance(check: Check) -> float:
    if not _precision.lookup(check.precision).reference:
        return LOW_PRECISION_TOLERANCE
    return TOLERANCES["cuda" if check.accelerator == "cuda" else "cpu"]
