"""The benchmark matrix: which configurations ``paratrain bench`` runs, and why some cannot run here.

Cells are, in order:

* ``matrix``: every strategy × world size × precision (strategies that run in one process only at
  world size 1, the others at world sizes above 1), plus DDP comm hooks × world sizes at fp32;
  a strategy that pipelines micro-batches inside its one process (``devices``) runs sequential and
  pipelined (``micro_batches`` chunks per batch);
* ``baseline``: a hand-written plain-PyTorch DDP loop (:mod:`paratrain.bench.baseline`) at each world
  size above 1, the overhead reference for paratrain's ``ddp``;
* ``mesh``: each composed layout asked for (``--mesh pp=2,dp_shard=2``) at every world size it makes;
* ``trap``: the effective-batch trap at the largest world size N: the same global batch,
  the global batch grown ×N (the per-worker batch kept, as many scripts do), and the grown batch with
  the linear scaling rule plus warmup (Goyal et al. 2017). Every cell trains the same epochs, so
  the grown batch makes N× fewer optimizer steps.

A cell that cannot run on this machine keeps its place, with ``skip`` saying why.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import precision as _precision
from .. import strategies as _strategies
from ..config import TrainConfig
from ..data.sampler import check_dataset_fits, full_batches
from ..env.devices import available_accelerator
from ..strategies.ddp import COMM_HOOKS

__all__ = ["Cell", "BenchSpec", "build_matrix", "annotate", "quick_spec", "full_spec", "cuda_devices", "BASELINE"]

BASELINE = "plain-ddp"  # the hand-written loop's strategy name in a Cell


@dataclass(kw_only=True, frozen=True)
class Cell:
    """One configuration of the matrix: what runs, on how many processes, in which precision."""

    strategy: str
    """A paratrain strategy name, or ``plain-ddp`` for the hand-written baseline loop."""
    world_size: int = 1
    """Processes (devices for ``dp``)."""
    precision: str = _precision.reference()
    comm_hook: str = "none"
    """DDP gradient compression: none, fp16, bf16, powersgd."""
    backend: str = "auto"
    micro_batches: int = 1
    """In-process pipelining (strategies with ``in_process_micro_batches``): chunks per batch; 1: none."""
    global_batch: int
    base_batch: int | None = None
    """Linear scaling rule: lr × global_batch / base_batch (None: lr unchanged)."""
    lr_warmup_steps: int = 0
    sets_lr_rule: bool = False
    """The cell trains with ``base_batch`` and ``lr_warmup_steps`` (the trap cells that grow the
    batch); others keep the job's own lr rule (``optim.base_batch``, ``optim.warmup_steps``)."""
    mesh: str = ""
    """A composed layout (``pp=2,dp_shard=2``: :mod:`paratrain.strategies.mesh`); "" for the strategy's own."""
    group: str = "matrix"
    """matrix, baseline, trap or mesh."""
    note: str = ""
    skip: str | None = None
    """Why this cell cannot run here (None: it runs)."""

    @property
    def label(self) -> str:
        name = "plain DDP (hand-written)" if self.strategy == BASELINE else self.strategy
        if self.mesh:
            name = f"mesh {self.mesh}"
        one = self.strategy != BASELINE and self.strategy_class.processes == "one"
        parts = [name if self.world_size == 1 and one else f"{name} x{self.world_size}"]
        if self.precision != _precision.reference():
            parts.append(self.precision)
        if self.comm_hook != "none":
            parts.append(f"hook={self.comm_hook}")
        if self.micro_batches != 1:
            parts.append(f"pipelined x{self.micro_batches} micro-batches")
        if self.backend != "auto":
            parts.append(self.backend)
        if self.group == "trap":
            parts.append(f"batch {self.global_batch}")
            if self.base_batch:
                parts.append(f"lr x{self.global_batch // self.base_batch} + warmup {self.lr_warmup_steps}")
        return " ".join(parts)

    @property
    def config_strategy(self) -> str:
        """The paratrain strategy this cell's config names (the baseline's: plain data parallel)."""
        return _strategies.data_parallel_reference() if self.strategy == BASELINE else self.strategy

    @property
    def strategy_class(self) -> type[_strategies.Strategy]:
        """The class of :attr:`config_strategy`: ask it what the cell can do, never compare names."""
        return _strategies.resolve(self.config_strategy)

    def run_key(self) -> tuple[Any, ...]:
        """Cells with the same key train identically; the runner runs such a cell once."""
        lr_rule = (self.base_batch, self.lr_warmup_steps) if self.sets_lr_rule else "the job's"
        return (self.strategy, self.mesh, self.world_size, self.precision, self.comm_hook, self.backend,
                self.micro_batches, self.global_batch, lr_rule)

    def overrides(self) -> dict[str, Any]:
        """Dotted config keys this cell sets on the base :class:`~paratrain.config.TrainConfig`."""
        out: dict[str, Any] = {
            "parallel.strategy": self.config_strategy,
            "parallel.precision": self.precision,
            "parallel.global_batch": self.global_batch,
            "parallel.backend": self.backend,
            "parallel.ddp.comm_hook": self.comm_hook,
        }
        if self.mesh:
            out["parallel.mesh"] = self.mesh
        if self.micro_batches != 1:  # the strategy's own section: [parallel.<name>] micro_batches
            out[f"parallel.{self.config_strategy}.micro_batches"] = self.micro_batches
        if self.sets_lr_rule:  # the trap cells that grow the batch set the lr rule; other cells keep the config's
            out["optim.base_batch"] = self.base_batch
            out["optim.warmup_steps"] = self.lr_warmup_steps
        return out


@dataclass(kw_only=True)
class BenchSpec:
    """What ``paratrain bench`` measures: the matrix dimensions and the run length."""

    strategies: list[str] = field(default_factory=_strategies.bench_defaults)
    """Strategies to try: names from paratrain's registry (an unknown name is an error up front).
    By default those whose class sets ``bench_default`` to quick or full (all of them)."""
    world_sizes: list[int] = field(default_factory=lambda: [1, 2, 4])
    precisions: list[str] = field(default_factory=_precision.bench_defaults)
    """By default those whose class sets ``bench_default`` to quick or full (32, fp16-mixed, bf16-mixed)."""
    comm_hooks: list[str] = field(default_factory=lambda: ["none", "fp16", "bf16", "powersgd"])
    """DDP comm hooks; each one other than none adds a ddp cell per world size (fp32)."""
    micro_batches: int = 4
    """Strategies that pipeline micro-batches inside one process (``in_process_micro_batches``:
    devices) get a pipelined cell with this many chunks per batch beside the sequential one; 1: none."""
    epochs: int = 3
    """Every cell trains this many epochs (so a grown global batch makes fewer steps)."""
    warmup_steps: int = 5
    """Untimed first optimizer steps of every cell (process-group setup, allocator warm-up)."""
    meshes: list[str] = field(default_factory=list)
    """Composed layouts (``pp=2,dp_shard=2``), each at every world size of :attr:`world_sizes` it
    makes, in every precision, beside the strategies."""
    baseline: bool = True
    """Add the hand-written plain-PyTorch DDP loop at each world size above 1."""
    trap: bool = True
    """Add the effective-batch cells at the largest world size."""
    nccl_cells: bool = True
    """On a machine without CUDA, list ddp-over-nccl cells as skipped (so the table says why)."""
    tolerance: float = 0.02
    """The recommendation keeps configurations whose test accuracy is at most this much below single's."""
    threads: int = 1
    """torch intra-op threads per process on CPU: one 'device' per process."""
    cell_timeout: float = 300.0
    """Seconds before a cell's processes are killed and the cell is marked failed."""

    def __post_init__(self) -> None:
        # Every name is checked before any cell runs: a typo fails at once, not after the matrix.
        for name in self.strategies:
            _strategies.resolve(name)
        # Aliases (fp32, bf16, O1...) become their canonical names: the fp32 reference, the probes and
        # the labels know those, and "32,fp32" is one precision, not two.
        self.precisions = list(dict.fromkeys(_precision.resolve(name) for name in self.precisions))
        for hook in self.comm_hooks:
            if hook not in COMM_HOOKS:
                raise ValueError(f"comm hook {hook!r} is unknown: use one of {', '.join(COMM_HOOKS)}")
        from ..strategies.mesh import MeshOptions

        layouts = [MeshOptions.parse(text) for text in self.meshes]  # a bad spelling fails here, at once
        self.meshes = [str(m) for m in layouts]
        for m in layouts:
            if not any(_makes(m, w) for w in self.world_sizes):
                raise ValueError(f"mesh {m} makes none of the world sizes {','.join(map(str, self.world_sizes))}: "
                                 f"add {m.smallest_world()} to the world sizes")
        if not (self.strategies or self.meshes) or not self.precisions:
            raise ValueError("bench needs at least one strategy and one precision")
        if not self.world_sizes or any(w < 1 for w in self.world_sizes):
            raise ValueError(f"world sizes {self.world_sizes} must be positive integers")
        if self.epochs < 1:
            raise ValueError(f"bench epochs {self.epochs} must be at least 1")
        if self.micro_batches < 1:
            raise ValueError(f"bench micro_batches {self.micro_batches} must be at least 1")
        if self.warmup_steps < 0:
            raise ValueError(f"bench warmup_steps {self.warmup_steps} must be >= 0")
        if self.threads < 1:
            raise ValueError(f"bench threads {self.threads} must be at least 1")
        if self.cell_timeout <= 0:
            raise ValueError(f"bench cell_timeout {self.cell_timeout} must be positive")
        if not 0 <= self.tolerance <= 1:
            raise ValueError(f"bench tolerance {self.tolerance} must be an accuracy difference in [0, 1]")


def _makes(mesh: Any, world: int) -> bool:
    try:
        mesh.sizes(world)
    except ValueError:
        return False
    return True


def quick_spec() -> BenchSpec:
    """``--quick``: about 20 s on a 2-core CPU: world sizes 1 and 2, fp32 and bf16, the fp16 and
    PowerSGD hooks, the baseline and the trap, 2 epochs each (11 launches; each cell forks from a
    server that imported the worker once, see :mod:`paratrain.bench.runner`)."""
    return BenchSpec(strategies=_strategies.bench_defaults(quick=True), world_sizes=[1, 2],
                     precisions=_precision.bench_defaults(quick=True), comm_hooks=["none", "fp16", "powersgd"], epochs=2, warmup_steps=3,
                     cell_timeout=120.0)


def full_spec() -> BenchSpec:
    return BenchSpec()


def cuda_devices(accelerator: str = "auto") -> int:
    """CUDA devices the cells will run on, as their processes choose them (``select_device``): the
    visible GPUs, or none when the config's ``accelerator`` picks the CPU (or another accelerator)
    or this CUDA build finds no GPU."""
    if accelerator not in ("auto", "cuda"):
        return 0
    found = available_accelerator()
    return found[1] if found is not None and found[0] == "cuda" else 0


def _probe_precision(precision: str, device: str) -> str | None:
    """Why ``precision`` cannot run on ``device`` here, or None."""
    why = _precision.lookup(precision).unsupported(torch.device(device))  # its own answer first (fp8-mixed's)
    if why is not None:
        return why
    dtype = _precision.lookup(precision).param_dtype  # what it computes in, under autocast
    if dtype is None:
        return None
    if device == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support"
    try:
        lin = torch.nn.Linear(4, 4).to(device)
        with torch.autocast(device, dtype=dtype):
            out = lin(torch.randn(2, 4, device=device))
        out.float().sum().backward()
    except (RuntimeError, TypeError) as e:
        return f"autocast to {dtype} fails on {device}: {str(e).splitlines()[0]}"
    return None


def _config_error(base: TrainConfig, cell: Cell) -> str | None:
    """The one-line config validation error this cell would hit (pipeline + fp16 ...), or None."""
    try:
        base.with_overrides(cell.overrides())
    except (ValueError, FileNotFoundError) as e:
        return str(e)
    return None


def _machine_skip(cell: Cell, gpus: int) -> str | None:
    """Why this machine cannot run ``cell`` (devices, backends), or None."""
    cls = cell.strategy_class
    if cls.drives_all_local_devices and cell.world_size > 1 and gpus < cell.world_size:
        return (f"DataParallel over {cell.world_size} GPUs needs {cell.world_size} GPUs in one process; "
                f"{gpus} visible")
    if cell.comm_hook == "bf16" and gpus == 0:
        return "the bf16 compression hook needs CUDA with NCCL 2.10+ (torch refuses it on gloo)"
    if cell.backend == "nccl" and gpus == 0:
        return "nccl needs CUDA GPUs; none visible (the gloo cells above are the CPU equivalent)"
    if gpus and cls.processes != "one" and cell.world_size > gpus:
        return f"{cell.world_size} processes need {cell.world_size} GPUs; {gpus} visible"
    return None


def _fit_error(train_size: int, global_batch: int) -> str | None:
    """Why the training set cannot fill one of the cell's global batches, or None."""
    try:
        check_dataset_fits(train_size, global_batch)
    except ValueError as e:
        return str(e)
    return None


def build_matrix(spec: BenchSpec, base: TrainConfig, train_size: int) -> list[Cell]:
    """Every cell of ``spec`` on top of the base config ``base``, skipped ones included."""
    batch = base.parallel.global_batch
    gpus = cuda_devices(base.parallel.accelerator)
    cells: list[Cell] = []
    worlds = sorted(set(spec.world_sizes))
    multi = [w for w in worlds if w > 1]
    plain = _strategies.data_parallel_reference()  # the comm-hook, nccl and trap cells' strategy

    for strategy in spec.strategies:  # known names: BenchSpec checked them
        # One-process strategies run at world 1, except those driving N local GPUs (dp: world = GPUs);
        # the rest use N processes.
        cls = _strategies.resolve(strategy)
        one_process = cls.processes == "one" and not cls.drives_all_local_devices
        sizes = [1] if one_process else multi
        chunks = [1, spec.micro_batches] if cls.in_process_micro_batches and spec.micro_batches > 1 else [1]
        for w in sizes:
            for precision in spec.precisions:
                cells += [Cell(strategy=strategy, world_size=w, precision=precision, micro_batches=k, global_batch=batch)
                          for k in chunks]
    for text in spec.meshes:
        from ..strategies.mesh import MeshOptions

        mesh = MeshOptions.parse(text)
        cells += [Cell(strategy=_strategies.for_mesh(mesh), mesh=text, world_size=w, precision=precision,
                       global_batch=batch, group="mesh") for w in worlds if _makes(mesh, w) for precision in spec.precisions]
    for hook in spec.comm_hooks:
        if hook != "none":
            cells += [Cell(strategy=name, world_size=w, comm_hook=hook, global_batch=batch)
                      for name, cls in _strategies.STRATEGIES.items()
                      if name in spec.strategies and hook in cls.comm_hooks for w in multi]  # the strategies asked for
    if spec.nccl_cells and not gpus and plain in spec.strategies:
        cells += [Cell(strategy=plain, world_size=w, backend="nccl", global_batch=batch) for w in multi]
    if spec.baseline:
        cells += [Cell(strategy=BASELINE, world_size=w, global_batch=batch, group="baseline",
                       note="a typical hand-written loop: DistributedSampler + set_epoch, DDP, per-worker batch "
                            f"{batch // w}; no peak memory: its processes also run paratrain's loop, for the "
                            "overhead") for w in multi]
    if spec.trap and multi:
        n = max(multi)
        grown = batch * n
        steps = full_batches(train_size, grown) * spec.epochs
        warm = max(1, steps // 4)
        cells += [
            Cell(strategy=plain, world_size=n, global_batch=batch, group="trap",
                 note=f"global batch kept at {batch} ({batch // n} per worker): paratrain's default"),
            Cell(strategy=plain, world_size=n, global_batch=grown, group="trap", sets_lr_rule=True,
                 note=f"per-worker batch kept at {batch}: global x{n}, lr unchanged (the common mistake)"),
            Cell(strategy=plain, world_size=n, global_batch=grown, base_batch=batch, lr_warmup_steps=warm,
                 group="trap", sets_lr_rule=True, note=f"global x{n} with the linear scaling rule (lr x{n}) and {warm} warmup steps"),
        ]

    return annotate(cells, base, train_size)


def annotate(cells: list[Cell], base: TrainConfig, train_size: int) -> list[Cell]:
    """``cells`` with ``skip`` set where this machine, the precision, the config or the data size
    cannot run them (the reason in one line)."""
    gpus = cuda_devices(base.parallel.accelerator)
    device = "cuda" if gpus else "cpu"
    probes: dict[str, str | None] = {}
    out = []
    for cell in cells:
        why: str | None = cell.skip or _machine_skip(cell, gpus)
        if why is None and cell.precision not in probes:
            probes[cell.precision] = _probe_precision(cell.precision, device)
        why = why or probes.get(cell.precision) or _config_error(base, cell)
        if why is None:
            why = _fit_error(train_size, cell.global_batch)
        if why is None and cell.strategy == BASELINE and cell.global_batch % cell.world_size:
            why = f"global batch {cell.global_batch} does not split over {cell.world_size} workers"
        out.append(replace(cell, skip=why) if why else cell)
    return out
