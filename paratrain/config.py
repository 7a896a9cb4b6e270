"""Typed, self-validating configuration (torchtitan style), loadable from TOML/YAML with overrides.

A config file mirrors the dataclasses: top-level keys of :class:`TrainConfig`, and tables
``[parallel]``, ``[parallel.ddp]``, ``[data]``, ``[optim]``. Any field can be overridden from
the command line with ``--set section.field=value``.

One path builds a config: :meth:`TrainConfig.load` (a file plus dotted overrides, validated once);
one derives another from it: :meth:`TrainConfig.with_overrides`. Code passes the dataclass around,
never the dict it came from.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import math
import numbers
import operator
import os
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from torch import nn
from torch.utils.data import Dataset

from . import precision as _precision
from . import strategies as _strategies
from .data.datasets import build_dataset, dataset_info, dataset_size
from .data.sampler import BatchPlan
from .env import defaults as launch_defaults
from .env.detect import detect_process
from .tracking import parse_log_to
from .tracking.runs import LATEST

__all__ = ["ParallelConfig", "DataConfig", "OptimConfig", "TrainConfig", "load_config", "apply_overrides", "from_dict",
           "parse_set", "parallel_defaults"]


BACKENDS = ("auto", "gloo", "nccl", "mpi", "xccl", "hccl")
ACCELERATORS = ("auto", "cpu", "cuda", "xpu", "mps")
_SCHEDULES = ("constant", "cosine", "linear", "step")  # paratrain.loop.schedule builds them


def _strategy_sections(cls: type) -> type:
    """Give ``cls`` a field per registered strategy with options, after its own fields, in registry
    order: ``ddp: DDPOptions`` is the ``[parallel.ddp]`` section (``--set parallel.ddp.comm_hook=fp16``).
    A new strategy's section comes from its registry row and its class's ``options_class``."""
    for name, strategy in _strategies.STRATEGIES.items():
        if strategy.options_class is not None:
            cls.__annotations__[name] = strategy.options_class
            setattr(cls, name, field(default_factory=strategy.options_class))
    return cls


@dataclass(kw_only=True)
@_strategy_sections
class ParallelConfig:
    """How one job is spread over processes and devices; one section per strategy with options
    (``ddp``, ``fsdp``, ``tensor``, ``pipeline``, ``devices``, ``ps``: their ``Options`` dataclasses)."""

    strategy: str = _strategies.reference()
    """single, dp, ddp, fsdp (sharded data parallel, ZeRO-3/ZeRO-2-like) or tensor (Linear layers
    split over processes, optionally combined with fsdp on a 2-D mesh). Also pipeline (one model stage
    per process), devices (model parts on several devices of one process) and ps (parameter server)."""
    precision: str = _precision.reference()
    """32, tf32, fp16-mixed, bf16-mixed, bf16-true or fp16-true (low-precision weights with fp32
    master weights); Apex aliases O0, O1 (fp16-mixed), O2 and O3 (fp16-true)."""
    global_batch: int = 64
    """Samples per optimizer step, summed over all workers. Fixed when the world size changes."""
    accumulation: int | None = None
    """Micro-steps per optimizer step; derived from micro_batch when that is set, else 1."""
    micro_batch: int | None = None
    """Samples per worker per forward; set it (instead of accumulation) to cap memory."""
    sync_batchnorm: bool = False
    """Compute BatchNorm statistics over the global micro-batch (CPU/gloo too)."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm to this value."""
    loss_scale: float | None = None
    """Static fp16 loss scale (128 is a common first choice); None means dynamic GradScaler."""
    seed: int = 0
    """Seeds model init, data order and augmentation: the same on every rank."""
    backend: str = "auto"
    """auto (nccl on CUDA, else gloo), gloo, nccl or mpi."""
    accelerator: str = "auto"
    """auto, cpu, cuda, xpu or mps."""
    timeout_s: float = 600.0
    """Collective timeout: a missing rank fails the job after this long instead of hanging."""
    compile: bool = False
    """torch.compile the set-up model (after DDP/FSDP wrapping). Checkpoints keep the uncompiled keys."""
    compile_backend: str = "inductor"
    """torch.compile's backend (inductor needs a C++ compiler on CPU; eager and aot_eager do not)."""
    activation_checkpointing: Any = None
    """Blocks whose activations are recomputed in the backward instead of kept: class names (or, from
    Python, classes or a callable module -> bool), e.g. ["Block"]. None: keep every activation."""
    # ... then the strategies' sections, added from the registry (_strategy_sections): Any to a type checker
    if typing.TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any: ...

    def __post_init__(self) -> None:
        for name, strategy in _strategies.STRATEGIES.items():
            section = getattr(self, name, None)
            if strategy.options_class is not None and isinstance(section, Mapping):
                setattr(self, name, from_dict(strategy.options_class, section, f"parallel.{name}"))
        _strategies.resolve(self.strategy)
        if isinstance(self.activation_checkpointing, str):  # from the command line: "Block,Layer"
            self.activation_checkpointing = [c.strip() for c in self.activation_checkpointing.split(",") if c.strip()]
        if self.activation_checkpointing is not None:
            from .nn.checkpointing import checkpoint_policy

            checkpoint_policy(self.activation_checkpointing)  # one-line error for a bad value, before any process starts
        self.precision = _precision.resolve(self.precision)
        for name in ("global_batch", "accumulation", "micro_batch", "seed"):
            setattr(self, name, _integer(getattr(self, name), name))
        for name in ("sync_batchnorm", "compile"):
            value = getattr(self, name)
            if str(getattr(value, "dtype", "")) == "bool" and getattr(value, "ndim", 1) == 0:  # NumPy's bool
                setattr(self, name, value := bool(value))
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be true or false")
        for name in ("clip_grad_norm", "loss_scale", "timeout_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                raise ValueError(f"{name}={value!r} must be a number")
        if self.global_batch < 1:
            raise ValueError(f"global_batch {self.global_batch} must be at least 1")
        if not -2**63 <= self.seed < 2**63:
            raise ValueError(f"seed {self.seed} does not fit in 64 bits: use one below 2**63, e.g. 0")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:  # NaN too
            raise ValueError(f"clip_grad_norm {self.clip_grad_norm} must be a positive number (inf: measure, never clip)")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s {self.timeout_s} must be a positive number of seconds")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is unknown: use one of {', '.join(BACKENDS)}")
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator {self.accelerator!r} is unknown: use one of {', '.join(ACCELERATORS)}")
        if self.loss_scale is not None and not _precision.lookup(self.precision).scales_loss:
            scaled = " or ".join(n for n, c in _precision.PRECISIONS.items() if c.scales_loss)
            raise ValueError(f"loss_scale {self.loss_scale} only applies to precision {scaled}, not {self.precision}")
        self.strategy_class.validate(self)

    @classmethod
    def option_names(cls) -> list[str]:
        """The fields, in order: ``Parallel``'s keyword options (a test holds its signature to them)."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def options_help(cls) -> str:
        """Napoleon ``Args:`` entries (indented for a class docstring) for every field, from the
        docstring under it here, or for a strategy's section from its options class: how
        :class:`paratrain.Parallel` documents its keyword options without a second copy."""
        docs = _field_docs(cls)
        for name, strategy in _strategies.STRATEGIES.items():
            if strategy.options_class is not None:
                first = (strategy.options_class.__doc__ or "").strip().split("\n\n")[0]
                docs[name] = (f"The ``[parallel.{name}]`` section: a :class:`~{strategy.options_class.__module__}."
                              f"{strategy.options_class.__qualname__}` or a dict of its fields. {' '.join(first.split())}")
        return "".join(f"        {name}: {docs.get(name, 'See ParallelConfig.')}\n" for name in cls.option_names())

    @classmethod
    def of(cls, config: ParallelConfig | None, options: Mapping[str, Any]) -> ParallelConfig:
        """``config``, or one of the keyword ``options`` (``Parallel(strategy="ddp")``); not both, and
        an unknown option is a one-line error naming the known ones.

        Keyword options apply over the defaults chosen at launch (``paratrain run --strategy ddp``, a
        project's ``paratrain.toml``, handed over in ``PARATRAIN_PARALLEL``): the code wins, and where the two
        disagree one line on the main process names both. A ``ParallelConfig`` is taken as it is."""
        if config is not None and options:
            raise ValueError("pass either a ParallelConfig or keyword arguments, not both")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown Parallel option {unknown[0]!r}: known options are {', '.join(sorted(known))}")
        return config or cls(**_over_launch_defaults(options))

    @property
    def strategy_class(self) -> type[_strategies.Strategy]:
        """The class of the configured strategy: ask it what it can do, never compare its name."""
        return _strategies.resolve(self.strategy)

    def strategy_options(self) -> Any:
        """The options section of the configured strategy (``self.ddp`` for ddp...), or None."""
        return getattr(self, self.strategy, None)

    def data_parallel_size(self, world: int) -> int:
        """Data shards for ``world`` processes under the configured strategy (tensor/pipeline share batches)."""
        return self.strategy_class.data_parallel_size_for(world, self.strategy_options())

    def batch_plan(self, world: int, given: BatchPlan | None = None) -> BatchPlan:
        """How the global batch splits over ``world`` processes (a one-line error if it cannot):
        ``given``, a plan made earlier in this process for the same world (handed down, not derived
        again), or derived here."""
        shards = self.data_parallel_size(world)
        if given is not None:
            if (given.global_batch, given.world_size) != (self.global_batch, shards):
                raise ValueError(f"the batch plan ({given}) is not this config's over {world} process(es)")
            return given
        return BatchPlan.derive(self.global_batch, shards, self.accumulation, self.micro_batch)


def _field_docs(cls: type) -> dict[str, str]:
    """``{field: its docstring on one line}`` from ``cls``'s source (empty where the source is not shipped)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return {}
    return {node.target.id: " ".join(after.value.value.split()) for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


@dataclass(kw_only=True)
class DataConfig:
    """Which data, and how it is loaded."""

    dataset: str = "digits"
    """digits (bundled, real), cifar10 (needs data_dir), synthetic (throughput only)."""
    data_dir: str | None = None
    """Folder holding cifar-10-batches-py (for cifar10)."""
    synthetic_size: int = 4096
    """Number of training samples of the synthetic dataset."""
    augment: bool = True
    """Batched random crop + flip on the device (cifar10/synthetic)."""
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"num_workers {self.num_workers} must be >= 0")
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError("persistent_workers needs num_workers > 0")
        if self.dataset == "cifar10" and self.data_dir is None:
            raise ValueError("dataset cifar10 needs --data-dir: the folder holding cifar-10-batches-py")
        if self.dataset == "cifar10" and not os.path.isdir(self.data_dir):  # type: ignore[arg-type]
            what = "is a file, not a folder" if os.path.exists(self.data_dir) else "does not exist"  # type: ignore[arg-type]
            raise FileNotFoundError(f"data_dir {self.data_dir!r} {what}: point --data-dir at the folder holding "
                                    "cifar-10-batches-py")


@dataclass(kw_only=True)
class OptimConfig:
    """SGD with momentum (the seeds' optimizer), or AdamW; an LR schedule after a linear warmup,
    and linear scaling."""

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_steps: int = 0
    """Linear warmup over this many optimizer steps: with ``base_batch`` scaling the lr up, from the
    base lr to the scaled one (Goyal et al.'s gradual warmup); otherwise from lr/warmup_steps to lr."""
    schedule: str = "constant"
    """After warmup: constant, cosine or linear (decay to lr x min_lr_ratio at the last step), or step."""
    min_lr_ratio: float = 0.0
    """cosine/linear: the final lr as a fraction of the peak lr."""
    step_size: int = 0
    """step: multiply the lr by gamma every step_size optimizer steps (required for step)."""
    gamma: float = 0.1
    """step: the factor applied every step_size steps."""
    base_batch: int | None = None
    """Linear scaling rule: lr is multiplied by global_batch / base_batch when set."""

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adamw"):
            raise ValueError(f"optimizer {self.name!r} is unknown: use sgd or adamw")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr {self.lr} must be a positive finite number, e.g. 0.05")
        for name in ("momentum", "weight_decay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} {value} must be a finite number >= 0")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps {self.warmup_steps} must be >= 0")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is unknown: use one of {', '.join(_SCHEDULES)}")
        if not (math.isfinite(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"min_lr_ratio {self.min_lr_ratio} must be between 0 and 1")
        if self.schedule == "step" and self.step_size < 1:
            raise ValueError(f"schedule 'step' needs step_size >= 1 (got {self.step_size}): "
                             "set optim.step_size to the steps between lr drops")
        if not (math.isfinite(self.gamma) and 0 < self.gamma <= 1):
            raise ValueError(f"gamma {self.gamma} must be in (0, 1]")
        if self.base_batch is not None and self.base_batch < 1:
            raise ValueError(f"base_batch {self.base_batch} must be at least 1")


@dataclass(kw_only=True)
class TrainConfig:
    """A whole ``paratrain train`` job."""

    model: str = "mlp"
    """mlp, cnn, resnet8, resnet20, resnet50, transformer, or torchvision:<name>."""
    epochs: int = 10
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides epochs when reached first)."""
    log_dir: str | None = "runs/{name}"
    """CSV/JSONL logs and result.json go here (main process only). ``{name}`` is the run's name
    (``name``, else the start time), and its parent gets a ``latest`` link to the newest run. None: no files."""
    name: str | None = None
    """The run's name: its folder under runs/ (default: the start time, 20250101-120000)."""
    log_every: int = 10
    progress: bool = True
    log_to: list[str] = field(default_factory=lambda: ["csv"])
    """Where the logged metrics go: csv (CSV + JSONL in log_dir), tensorboard (<log_dir>/tensorboard),
    wandb, mlflow (a SQLite store, <log_dir>/mlflow.db, unless MLFLOW_TRACKING_URI is set), comet; comma-separated
    on the command line."""
    tensorboard: bool = False
    """Also log to TensorBoard (the same as adding tensorboard to log_to; pip install tensorboard)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many optimizer steps (0: only at the end, if checkpoint_dir is set)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; defaults to <log_dir>/checkpoints when checkpoint_every > 0 or resume is set."""
    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep."""
    checkpoint_async: bool = False
    """Write checkpoints in the background (DCP's async save for sharded models): the state is copied
    at the step and training goes on while it is written; the next checkpoint waits for it."""
    max_nonfinite_steps: int = 3
    """Stop the run with an error when the loss is NaN or inf for this many consecutive optimizer
    steps (checked at every log and checkpoint step; no checkpoint is written after a NaN)."""
    resume: bool = False
    """Continue from the newest loadable checkpoint in checkpoint_dir. After torchrun restarts a
    failed worker group (--max-restarts) this happens automatically."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        for name, cls in (("parallel", ParallelConfig), ("data", DataConfig), ("optim", OptimConfig)):
            if isinstance(getattr(self, name), Mapping):
                setattr(self, name, from_dict(cls, getattr(self, name), name))
        if self.epochs < 1:
            raise ValueError(f"epochs {self.epochs} must be at least 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps {self.max_steps} must be at least 1")
        if self.log_every < 1:
            raise ValueError(f"log_every {self.log_every} must be at least 1")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every {self.checkpoint_every} must be >= 0")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps {self.max_nonfinite_steps} must be at least 1")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints {self.keep_checkpoints} must be at least 1")
        if not isinstance(self.checkpoint_async, bool):
            raise ValueError(f"checkpoint_async={self.checkpoint_async!r} must be true or false")
        self.log_to = parse_log_to(self.log_to)  # unknown or not installed: the one-line error, before any process starts
        if self.tensorboard and "tensorboard" not in self.log_to:
            self.log_to.append("tensorboard")
        if self.name is not None and (not self.name.strip() or os.sep in self.name or self.name in (".", "..", LATEST)):
            raise ValueError(f"name {self.name!r} cannot be a run folder's name: use letters, digits, '-', '_'")
        for name in ("log_dir", "checkpoint_dir"):
            path = getattr(self, name)
            if path == "":
                raise ValueError(f"{name} is empty: give a folder (or none for no {name.removesuffix('_dir')}s)")
            if path and "{name}" in path and not re.search(r"(^|/)\{name\}(/|$)", path):
                raise ValueError(f"{name} {path!r}: {{name}} must be a whole folder of the path, e.g. runs/{{name}}")
        if self.checkpoint_dir is None and (self.checkpoint_every or self.resume) and self.log_dir is not None:
            self.checkpoint_dir = os.path.join(self.log_dir, "checkpoints")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume needs a checkpoint_dir (or a log_dir): set --checkpoint-dir")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ValueError(f"checkpoint_every {self.checkpoint_every} needs a checkpoint_dir (or a log_dir): set "
                             "--checkpoint-dir")

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
        """The config in the TOML/YAML file ``path`` (None: the defaults) with dotted ``overrides``
        (``{"parallel.strategy": "ddp"}``; strings are converted as ``--set`` values are), validated once.

        The file and the overrides are merged before validation, so an override may complete what
        the file alone leaves invalid (``dataset = "cifar10"`` in the file, ``--data-dir`` given).
        """
        return from_dict(cls, apply_overrides(load_config(path), overrides or {}))

    def with_overrides(self, overrides: Mapping[str, Any]) -> TrainConfig:
        """A new, validated config: this one with the dotted ``overrides`` set (``{"parallel.strategy":
        "ddp", "log_dir": None}``). An unknown key or a bad value is the one-line ``ValueError`` of
        :func:`from_dict` or ``__post_init__``, naming the key; ``self`` is left as it is.

        Values derived at validation stay as they were resolved (``checkpoint_dir`` from ``log_dir``):
        override both to change both.
        """
        return from_dict(type(self), apply_overrides(self.to_dict(), overrides))

    def for_run(self, name: str) -> TrainConfig:
        """This config with ``{name}`` in ``log_dir`` and ``checkpoint_dir`` replaced by ``name``."""
        fill = lambda path: None if path is None else path.replace("{name}", name)  # noqa: E731
        return dataclasses.replace(self, name=name, log_dir=fill(self.log_dir), checkpoint_dir=fill(self.checkpoint_dir))

    def as_new_run(self) -> TrainConfig:
        """This config as ``--config`` should read it back: a new run. The run's name goes back to
        ``{name}`` in ``log_dir`` and ``checkpoint_dir`` (a re-run gets its own folder instead of
        writing over this one); folders given outright stay as they are."""
        if not self.name:
            return dataclasses.replace(self, resume=False)
        segment = re.compile(rf"(^|/){re.escape(self.name)}(?=/|$)")
        unfill = lambda path: None if path is None else segment.sub(lambda m: m.group(1) + "{name}", path, count=1)  # noqa: E731
        return dataclasses.replace(self, name=None, resume=False, log_dir=unfill(self.log_dir),
                                   checkpoint_dir=unfill(self.checkpoint_dir))

    def dataset(self, train: bool = True) -> Dataset:
        """The configured training (or test) split: ``data.dataset`` read from ``data.data_dir``, the
        synthetic set of ``data.synthetic_size``, split and patterned by ``parallel.seed``. The one
        place that turns a config into its data: the job, its pre-launch checks, bench and verify."""
        d = self.data
        return build_dataset(d.dataset, train, d.data_dir, d.synthetic_size, self.parallel.seed)

    def train_size(self) -> int:
        """Samples in the training split: counted without building it where the data set can say
        (digits, synthetic: :func:`~paratrain.data.datasets.dataset_size`), else built and counted."""
        d = self.data
        n = dataset_size(d.dataset, True, d.data_dir, d.synthetic_size)
        return n if n is not None else len(self.dataset(train=True))  # type: ignore[arg-type]

    def build_model(self) -> nn.Module:
        """The configured model, built for the configured data's input shape and classes (a
        user's own dataset is built from ``data.data_dir`` to read them): the one place that turns
        a config into its model, for the job, bench's pre-launch check and its predictor."""
        from .models import build_model  # only where a model is built: not on every config load

        info = dataset_info(self.data.dataset, self.data.data_dir)
        return build_model(self.model, tuple(info["input_shape"]), info["num_classes"])

    def to_dict(self) -> dict[str, Any]:
        """This config as nested plain dicts (a deep copy), as :func:`load_config` reads a file."""
        return dataclasses.asdict(self)


# --- the defaults of Parallel() chosen at launch ---------------------------------------------

_NOTICED: set[str] = set()  # notices printed by this process (a loop building Parallel() again says nothing new)


def parallel_defaults(path: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None,
                      cwd: str | os.PathLike = ".", labels: Mapping[str, str] | None = None
                      ) -> tuple[dict[str, Any], dict[str, str]]:
    """The defaults of ``Parallel()`` that ``paratrain run`` hands to its workers: the ``[parallel]``
    table of the config file ``path`` (None: ``paratrain.toml`` in ``cwd``, if there is one) with the
    dotted ``overrides`` (``{"parallel.strategy": "ddp"}``: the command line's) over it, and where
    each dotted key came from (``labels[key]`` for an override, else "the command line"). The file
    and the overrides are validated as ``paratrain train --config`` validates them: a bad name or
    value is its one-line ``ValueError``."""
    label = "--config " + os.fspath(path) if path is not None else ""
    if path is None and os.path.isfile(project := os.path.join(cwd, launch_defaults.PROJECT_FILE)):
        path, label = project, os.path.join(os.path.abspath(cwd), launch_defaults.PROJECT_FILE)
    data = load_config(path)
    for key in overrides or {}:
        if not key.startswith("parallel."):
            raise ValueError(f"--set {key}: paratrain run sets the defaults of Parallel() only: use "
                             "--set parallel.<key>=<value>, e.g. --set parallel.seed=3")
    from_dict(TrainConfig, apply_overrides(copy.deepcopy(data), dict(overrides or {})))  # the one validation
    table = dict(data.get("parallel") or {})
    sources = dict.fromkeys(launch_defaults.dotted(table), label)
    for key, value in (overrides or {}).items():
        apply_overrides(table, {key.removeprefix("parallel."): value})
        sources[key.removeprefix("parallel.")] = (labels or {}).get(key, "the command line")
    return table, sources


def _over_launch_defaults(options: Mapping[str, Any]) -> dict[str, Any]:
    """``Parallel``'s keyword ``options`` over the defaults set at launch (the code wins); where the
    two disagree, one line on the main process names both values and where the default came from."""
    table, sources = launch_defaults.read()
    if not table:
        return dict(options)
    try:
        chosen = from_dict(ParallelConfig, table, "parallel")
    except ValueError as e:
        origin = sorted(set(sources.values()) - {launch_defaults.VARIABLE})
        raise ValueError(f"{e} (in the defaults set at launch, {launch_defaults.VARIABLE}"
                         + (f": from {', '.join(origin)})" if origin else ")")) from None
    defaults = {key: ({k: getattr(getattr(chosen, key), k) for k in value} if isinstance(value, Mapping)
                      else getattr(chosen, key)) for key, value in table.items()}
    merged, differ = dict(defaults), []
    for key, value in options.items():
        default = defaults.get(key)
        if isinstance(default, dict):  # a section: the code's keys over the launch's
            whole = dataclasses.is_dataclass(value) and not isinstance(value, type)  # an Options object
            given = dataclasses.asdict(value) if whole else value  # type: ignore[arg-type]
            merged[key] = {**default, **value} if isinstance(value, Mapping) else value
            if isinstance(given, Mapping):
                differ += [(f"{key}.{k}", given[k], v) for k, v in default.items() if k in given and given[k] != v]
            continue
        merged[key] = value
        if key in defaults and not _same(key, value, default):
            differ.append((key, value, default))
    if differ and detect_process().rank == 0:
        line = (f"paratrain: Parallel({', '.join(f'{k}={v!r}' for k, v, _ in differ)}) in the code wins over the "
                f"default{'s' if len(differ) > 1 else ''} set at launch: "
                + ", ".join(f"{k}={d!r} ({sources.get(k, launch_defaults.VARIABLE)})" for k, _, d in differ))
        if line not in _NOTICED:
            _NOTICED.add(line)
            print(line, file=sys.stderr, flush=True)
    return merged


def _same(key: str, given: Any, default: Any) -> bool:
    """Whether the code's ``given`` value of ``key`` is the launch's ``default`` (a precision's alias too)."""
    if key == "precision":
        try:
            return _precision.resolve(given) == default
        except ValueError:
            return False
    return bool(given == default)


# --- building from dicts, files and overrides ----------------------------------------------

def _integer(value: Any, name: str) -> Any:
    """``value`` as an ``int`` (a NumPy integer, or a float such as ``64 / 2``, with no fraction);
    None stays None; anything else is refused in one line naming it."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)) and float(value).is_integer():
        return int(float(value))  # 64 / 2, np.float32(64)
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name}={value!r} must be an integer")



def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` (possibly a command-line string) to the annotated type ``tp``."""
    if tp in (str, int, float, bool) and isinstance(value, (Mapping, list)):  # `[model]` table, --set model.x=1
        raise ValueError(f"{where} is a single value, not a "
                         f"{'section' if isinstance(value, Mapping) else 'list'} ({value!r})")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, args[0], where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ValueError(f"{where}={value!r} is not a boolean: use true or false")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ValueError(f"{where}={value!r} is not a number")
        try:
            out = tp(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}={value!r} is not {'an integer' if tp is int else 'a number'}") from None
        if tp is int and isinstance(value, float) and value != out:
            raise ValueError(f"{where}={value!r} is not an integer")
        return out
    if tp is str:
        return str(value)
    return value


def from_dict(cls: type, data: Mapping[str, Any], where: str = "config") -> Any:
    """Build dataclass ``cls`` from a mapping, refusing unknown keys with a one-line error."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names, key=str)  # YAML keys may be numbers too
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in [{where}]: known keys are {', '.join(sorted(names))}")
    kwargs = {}
    for key, value in data.items():
        tp = hints[key]
        name = f"{where}.{key}".removeprefix("config.")  # as --set spells it: parallel.seed
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):  # [parallel] given as `parallel = 5`, or --set parallel=x
                raise ValueError(f"{name} is a section of settings, not a value ({value!r}): set its keys, "
                                 f"e.g. --set {name}.<key>=<value>")
            kwargs[key] = from_dict(tp, value, name)
        else:
            kwargs[key] = _coerce(value, tp, name)
    return cls(**kwargs)


def load_config(path: str | os.PathLike | None) -> dict[str, Any]:
    """Read a TOML or YAML config file into a plain dict (empty when ``path`` is None)."""
    if path is None:
        return {}
    path = os.fspath(path)
    if not os.path.isfile(path):
        what = "is a folder, not a file" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"config file {path!r} {what}")
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"reading {path!r} needs PyYAML: pip install pyyaml, or use a .toml file") from None
        with open(path) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"config file {path!r} is not valid YAML: {' '.join(str(e).split())}") from None
    else:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10: the same parser, from PyPI
            import tomli as tomllib

        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"config file {path!r} is not valid TOML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a table of settings")
    return data


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``parallel.global_batch``) in a nested dict; returns the same dict."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"cannot set {dotted!r}: {p!r} is not a section")
        node[leaf] = value
    return data


def parse_set(items: Iterable[str]) -> dict[str, str]:
    """``--set KEY=VALUE`` items as dotted overrides (values stay strings: :func:`from_dict` converts
    them to each field's type), in the order given; a later item wins over an earlier one with the same key."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r} is not KEY=VALUE, e.g. --set parallel.global_batch=128")
        out[key] = value
    return out


def to_toml(cfg: Any) -> str:
    """``cfg`` (a config dataclass) as TOML that :func:`load_config` reads back into the same config.

    TOML has no null: a field at ``None`` is written as a comment when ``None`` is its default, and
    as ``"none"`` (which the loader reads as ``None``) otherwise.
    """
    head: list[str] = []
    tables: list[str] = []

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v) if not (isinstance(v, float) and not math.isfinite(v)) else ("nan" if v != v else
                                                                                         ("inf" if v > 0 else "-inf"))
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{value(str(k))} = {value(x)}" for k, x in v.items()) + "}"
        raise ValueError(f"cannot write {v!r} ({type(v).__name__}) as TOML")

    def table(obj: Any, name: str | None, out: list[str]) -> None:
        lines = []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                continue
            if v is None:  # TOML has no null: a comment where None is the default, else "none" (read as None)
                lines.append(f"# {f.name} = (unset)" if f.default is None else f'{f.name} = "none"')
            else:
                lines.append(f"{f.name} = {value(v)}")
        if name is not None:
            out.append(f"\n[{name}]")
        out.extend(lines)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                table(v, f.name if name is None else f"{name}.{f.name}", tables)

    table(cfg, None, head)
    return "\n".join(head + tables).strip() + "\n"
