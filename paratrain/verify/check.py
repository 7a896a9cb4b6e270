"""``verify``: train the same job at world size 1 and N (and with accumulation, and optionally in
another precision), compare final weights and loss curves, and name the classic mistakes.

Every run is a :func:`paratrain.launch` of fresh processes with a hard time limit. The reference is
world size 1 without accumulation; for a built-in config it uses the ``single`` strategy (the one
every strategy must match) and the run at N uses the config's strategy (``ddp`` when the config's
runs in one process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import strategies as _strategies
from ..strategies.mesh import describe as describe_mesh
from ..config import TrainConfig
from ..data.sampler import BatchPlan
from ..launch.spawn import LaunchError, launch
from .compare import Comparison, compare_runs
from .diagnose import Finding, RunView, diagnose
from .worker import load_entry, run_job

__all__ = ["VerifyOptions", "VerifyReport", "verify_config", "verify_entry", "format_report"]

_SMALL_DATA = ("digits", "synthetic")


@dataclass(kw_only=True)
class VerifyOptions:
    """What ``verify`` runs and how strict it is."""

    world_size: int = 2
    """N: the world size compared with 1."""
    steps: int = 20
    """Optimizer steps per run."""
    tolerance: float = 1e-5
    """Largest relative divergence per tensor (and of the loss curve) that passes."""
    accumulation: int | None = None
    """Also run world size 1 with this many accumulation steps (< 2: skip; None: 2 for a built-in
    job, skip for a user's function). A user's function gets it as the default of
    ``Parallel(accumulation=...)``; a run whose Parallel does not show it is an error."""
    precision: str | None = None
    """Also run world size 1 in this precision, against ``precision_tolerance`` (a user's function
    gets it as the default of ``Parallel(precision=...)``)."""
    precision_tolerance: float = 5e-2
    strategy: str | None = None
    """A user's function only: the strategy of the run at world size N, as the default of
    ``Parallel(strategy=...)`` (None: the function's own). A built-in job's is its config's."""
    timeout: float = 300.0
    """Seconds per run before its processes are killed."""
    threads: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"verify --nproc {self.world_size} must be at least 2 (it is compared with world size 1)")
        if self.steps < 1:
            raise ValueError(f"verify --steps {self.steps} must be at least 1")
        if self.tolerance <= 0 or self.precision_tolerance <= 0:
            raise ValueError(f"verify tolerances ({self.tolerance}, {self.precision_tolerance}) must be positive")
        if self.timeout <= 0:
            raise ValueError(f"verify --timeout {self.timeout} must be positive")
        if self.precision is not None:
            from ..precision import resolve

            self.precision = resolve(self.precision)
        if self.strategy is not None:
            _strategies.resolve(self.strategy)  # one line naming the known ones


@dataclass(kw_only=True)
class VerifyReport:
    title: str
    comparisons: list[Comparison] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    checks: list[tuple[str, str]] = field(default_factory=list)
    """(what, observation) lines for the checks that found nothing wrong."""

    @property
    def passed(self) -> bool:
        return all(c.passed or (c.expected and not c.error) for c in self.comparisons) \
            and not any(f.fail for f in self.findings)


def _launch(name: str, nprocs: int, job: dict[str, Any], opts: VerifyOptions,
            env: dict[str, str] | None = None) -> RunView:
    try:
        # forked from a server that imported torch once (its runs are 1 + N + 1 processes, each of
        # which would otherwise start python and import torch): as selftest's and bench's runs
        ranks = launch(run_job, nprocs, args=(job,), timeout=opts.timeout,
                       env={"OMP_NUM_THREADS": str(opts.threads), **(env or {})},
                       start_method="forkserver", preload=["paratrain.verify.worker"])
    except LaunchError as e:
        return RunView.merge(name, nprocs, None, error=str(e))
    return RunView.merge(name, nprocs, ranks)


def _compare(title: str, run: RunView, ref: RunView, tol: float) -> Comparison:
    if run.error or ref.error:
        return Comparison(title=title, tolerance=tol, error=run.error or f"the reference run failed: {ref.error}")
    return compare_runs(title, run.state, ref.state, tol, run.losses, ref.losses, ref.noise_gradients())


def _checks(ref: RunView, run: RunView, repeat: RunView | None, findings: list[Finding]) -> list[tuple[str, str]]:
    """One line per classic mistake that was looked for and not found."""
    causes = {f.cause for f in findings}
    out = []
    counted = bool(ref.samples and run.samples and ref.samples[0] > 0)  # inputs the probe could see
    if counted and "effective batch changed with world size" not in causes:
        out.append(("effective batch", f"{ref.samples[0]} samples per optimizer step at world size 1 and "
                                       f"{run.world_size}"))
    if not ({"data order differs across world sizes", "effective batch changed with world size"} & causes) \
            and counted and not run.error:
        out.append(("data order", f"the same samples in each of {min(len(ref.samples), len(run.samples))} steps "
                                  f"at world size 1 and {run.world_size}"))
    if repeat is not None and ref.samples and repeat.samples and \
            not ({"data order not seeded", "model initialisation not seeded"} & causes):
        out.append(("seeding", f"identical initial weights and samples in two runs at world size 1 ({ref.name}, "
                               f"{repeat.name})"))
    if run.error or ref.error:  # what a failed run did not do proves nothing
        return out
    if not run.unsynced_bn:
        out.append(("BatchNorm", "no unsynced BatchNorm layer at world size " + str(run.world_size)))
    elif "BatchNorm not synced across ranks" not in causes:
        out.append(("BatchNorm", f"{len(run.unsynced_bn)} unsynced BatchNorm layer(s), but no divergence"))
    if not ref.unused and ref.samples:
        out.append(("unused parameters", "every parameter got a gradient"))
    return out


def _finish(title: str, ref: RunView, main: RunView, extra: list[tuple[RunView, float]], repeat: RunView | None,
            opts: VerifyOptions, expected: dict[int, str] | None = None) -> VerifyReport:
    """The report: ``main`` and each ``extra`` run against ``ref``; ``expected`` (by ``id`` of a run)
    says why that run differs by design (it is then not a failure)."""
    report = VerifyReport(title=title)
    report.comparisons.append(_compare(f"{main.name} vs {ref.name}", main, ref, opts.tolerance))
    for run, tol in extra:
        report.comparisons.append(_compare(f"{run.name} vs {ref.name}", run, ref, tol))
        report.comparisons[-1].expected = (expected or {}).get(id(run))
    failed = {main.name} if not report.comparisons[0].passed else set()
    report.findings = diagnose(ref, [main], failed, repeat)
    for run, _ in extra:
        if run.error and run is not repeat:
            report.findings.append(Finding(cause=f"the {run.name} run failed", message=run.error))
    report.checks = _checks(ref, main, repeat, report.findings)
    return report


def verify_config(cfg: TrainConfig, opts: VerifyOptions) -> VerifyReport:
    """Verify a built-in job (a :class:`TrainConfig`, as ``paratrain train`` builds it)."""
    if opts.strategy is not None:
        raise ValueError(f"VerifyOptions(strategy={opts.strategy!r}) is for a user's function: a built-in job runs "
                         "its config's strategy (parallel.strategy)")
    n = opts.world_size
    strategy = cfg.parallel.strategy
    if cfg.parallel.strategy_class.processes == "one":  # N processes need one that runs on N
        strategy = _strategies.data_parallel_reference()
    base = cfg.with_overrides({"log_dir": None, "progress": False, "checkpoint_every": 0, "checkpoint_dir": None,
                               "resume": False})
    p = cfg.parallel
    accumulation = 2 if opts.accumulation is None else opts.accumulation
    BatchPlan.derive(p.global_batch, n, p.accumulation, p.micro_batch)  # one-line error if N does not divide it
    if accumulation > 1:
        BatchPlan.derive(p.global_batch, 1, accumulation)

    def job(**overrides: Any) -> dict[str, Any]:
        # the run's TrainConfig, validated here: a bad combination fails before any process starts
        return {"kind": "builtin", "config": base.with_overrides(overrides), "steps": opts.steps,
                "threads": opts.threads, "data": data, "timeout": opts.timeout}

    data = None
    if cfg.data.dataset in _SMALL_DATA:  # built once here instead of in every process
        data = cfg.dataset(train=True)
    single: dict[str, Any] = {"parallel.strategy": _strategies.reference(), "parallel.accumulation": None, "parallel.micro_batch": None,
              "parallel.mesh": {}}  # one process: no layout
    ref = _launch("world size 1", 1, job(**single), opts)
    if p.mesh.given:
        strategy = f"mesh {describe_mesh(p.layout(n))}"  # the layout is the config's mesh
    main = _launch(f"world size {n} ({strategy})", n, job(**({} if p.mesh.given else {"parallel.strategy": strategy})), opts)
    extra: list[tuple[RunView, float]] = []
    repeat: RunView
    if accumulation > 1:
        repeat = _launch(f"world size 1, accumulation {accumulation}", 1,
                         job(**{**single, "parallel.accumulation": accumulation}), opts)
    else:
        repeat = _launch("world size 1 (repeat)", 1, job(**single), opts)
    extra.append((repeat, opts.tolerance))
    if opts.precision is not None:
        extra.append((_launch(f"world size 1, {opts.precision}", 1,
                              job(**{**single, "parallel.precision": opts.precision}), opts), opts.precision_tolerance))
    report_extra = {}
    if accumulation > 1 and ref.unsynced_bn:
        report_extra[id(repeat)] = _batchnorm_accumulation(p.global_batch, accumulation)
    title = (f"paratrain verify: {cfg.model} on {cfg.data.dataset}, global batch {p.global_batch}, {opts.steps} "
             f"optimizer steps, {strategy} at world size {n} against one process; tolerance {opts.tolerance:g}")
    return _finish(title, ref, main, extra, repeat, opts, report_extra)


def verify_entry(entry: str, opts: VerifyOptions) -> VerifyReport:
    """Verify a user's training function ``module:function`` (see :mod:`paratrain.verify.worker`)."""
    load_entry(entry)  # a bad name fails here, with one line, before any process starts
    n = opts.world_size

    def job() -> dict[str, Any]:
        return {"kind": "entry", "entry": entry, "steps": opts.steps, "threads": opts.threads, "timeout": opts.timeout}

    def run(name: str, nprocs: int, **asked: Any) -> RunView:
        # The function sets up its own loop: what verify asks of a run reaches it as Parallel's
        # defaults (as `paratrain run --strategy S` hands them over), and its Parallel must show them.
        view = _launch(name, nprocs, job(), opts, env=_launch_defaults(asked) if asked else None)
        _check_taken(view, asked, n if nprocs > 1 else 1)
        return view

    strategy = f" ({opts.strategy})" if opts.strategy else ""
    ref = run("world size 1", 1)
    main = run(f"world size {n}{strategy}", n, **({"strategy": opts.strategy} if opts.strategy else {}))
    repeat = run("world size 1 (repeat)", 1)
    extra = [(repeat, opts.tolerance)]
    expected: dict[int, str] = {}
    a = opts.accumulation or 0
    if a > 1:
        accumulated = run(f"world size 1, accumulation {a}", 1, accumulation=a)
        extra.append((accumulated, opts.tolerance))
        if ref.unsynced_bn and ref.samples:
            expected[id(accumulated)] = _batchnorm_accumulation(ref.samples[0], a)
    if opts.precision is not None:
        extra.append((run(f"world size 1, {opts.precision}", 1, precision=opts.precision), opts.precision_tolerance))
    title = (f"paratrain verify: {entry}, {opts.steps} optimizer steps{strategy} at world size {n} against one "
             f"process; tolerance {opts.tolerance:g}")
    return _finish(title, ref, main, extra, repeat, opts, expected)


_ASKED_BY = {"strategy": "--strategy", "precision": "--also-precision", "accumulation": "--check-accumulation"}
"""The verify option that hands each of Parallel's defaults to a user's function."""


def _launch_defaults(asked: dict[str, Any]) -> dict[str, str]:
    """The environment that makes ``asked`` the defaults of ``Parallel(...)`` in the workers, over
    the launch defaults this process was given."""
    from ..env import defaults

    table, sources = defaults.read()
    return defaults.encode({**table, **asked}, {**sources, **{k: f"paratrain verify {_ASKED_BY[k]}" for k in asked}})


def _check_taken(run: RunView, asked: dict[str, Any], world: int) -> None:
    """Make ``run`` an error unless the ``paratrain.Parallel`` its function built ran what was asked."""
    if run.error or not asked:
        return
    flags = ", ".join(_ASKED_BY[k] for k in asked)
    if not run.parallel:
        run.error = (f"the function built no paratrain.Parallel, so {flags} could not reach it: {flags} apply "
                     "to a loop built on Parallel(); drop them")
        return
    ran = run.parallel[-1]
    want = {**asked, **({"strategy": _strategies.auto(world)} if asked.get("strategy") == _strategies.AUTO else {})}
    wrong = {k: v for k, v in want.items() if ran[k] != v}
    if wrong:
        run.error = ("the function's Parallel ran " + ", ".join(f"{k} {ran[k]}, not {v}" for k, v in wrong.items())
                     + f": it sets {', '.join(f'{k}=' for k in wrong)} itself (drop that, or "
                     f"{', '.join(_ASKED_BY[k] for k in wrong)})")


def _batchnorm_accumulation(global_batch: int, accumulation: int) -> str:
    # BatchNorm sees one micro-batch at a time: no setting makes accumulation equal a whole batch.
    return (f"BatchNorm normalises each micro-batch of {global_batch // accumulation} samples, not the global batch "
            f"of {global_batch}: accumulation changes a BatchNorm model's training (SyncBatchNorm syncs ranks, not "
            "micro-steps)")


def format_report(report: VerifyReport, max_tensors: int = 40) -> str:
    lines = [report.title, ""]
    for c in report.comparisons:
        if c.error:
            lines.append(f"{c.title}: FAIL ({c.error})")
            continue
        worst = c.worst
        loss = "n/a" if c.loss_divergence is None else f"{c.loss_divergence:.2e}"
        verdict = "PASS" if c.passed else f"DIFFERS, as expected: {c.expected}" if c.expected else "FAIL"
        lines.append(f"{c.title}: largest relative divergence {worst.divergence if worst else 0:.2e}"
                     f"{f' ({worst.name})' if worst else ''}, loss curve {loss}, tolerance {c.tolerance:g}: {verdict}")
        width = max([len(t.name) for t in c.tensors] + [6])
        # Every tensor of the main comparison (up to max_tensors); the worst few of a passing extra one.
        limit = max_tensors if c is report.comparisons[0] or not (c.passed or c.expected) else 3
        shown = sorted(c.tensors, key=lambda t: -t.divergence)[:limit]
        for t in shown:
            verdict = "not counted: its gradient is rounding noise" if t.noise else "PASS" if t.passed else "FAIL"
            lines.append(f"  {t.name:<{width}}  {t.divergence:9.2e}  {verdict}")
        if len(c.tensors) > len(shown):
            bound = shown[-1].divergence
            rest = "all equal" if bound == 0 else f"all at most {bound:.2e}"
            lines.append(f"  ... {len(c.tensors) - len(shown)} more tensors, {rest}")
    lines.append("")
    for f in report.findings:
        lines.append(f"{'FAIL' if f.fail else 'WARN'}: {f.cause}: {f.message}")
    for what, seen in report.checks:
        lines.append(f"ok: {what}: {seen}")
    lines += ["", f"result: {'PASS' if report.passed else 'FAIL'}"]
    return "\n".join(lines)
