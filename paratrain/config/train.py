"""``TrainConfig``: the job ``paratrain train`` (and ``verify``/``bench``) runs: ``[parallel]``, ``[data]``,
``[optim]`` and the run's own settings, built from a file and overrides by :meth:`TrainConfig.load`."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import nn
from torch.utils.data import Dataset

from ..data.datasets import build_dataset, dataset_info, dataset_size
from ..tracking import parse_log_to
from ..tracking.runs import LATEST
from .files import apply_overrides, from_dict, load_config
from .parallel import ParallelConfig

__all__ = ["DataConfig", "OptimConfig", "TrainConfig", "SCHEDULES"]

SCHEDULES = ("constant", "cosine", "linear", "step")  # paratrain.loop.schedule builds them


@dataclass(kw_only=True)
class DataConfig:
    """Which data, and how it is loaded."""

    dataset: str = "digits"
    """digits (bundled, real), cifar10 (needs data_dir), synthetic (throughput only), or tokens:PATH (a token
    file, nanoGPT's train.bin, or a folder with train.bin and val.bin: windows of block_size tokens, for gpt)."""
    data_dir: str | None = None
    """Folder holding cifar-10-batches-py (for cifar10)."""
    synthetic_size: int = 4096
    """Number of training samples of the synthetic dataset."""
    augment: bool = True
    """Batched random crop + flip on the device (cifar10/synthetic)."""
    block_size: int = 256
    """Tokens per sample of a tokens: dataset (the model's context)."""
    token_dtype: str = "uint16"
    """The token files' integer type: uint16 (nanoGPT's), uint32, int32 or int64."""
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"num_workers {self.num_workers} must be >= 0")
        if self.block_size < 1:
            raise ValueError(f"block_size {self.block_size} must be at least 1")
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
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is unknown: use one of {', '.join(SCHEDULES)}")
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
    """mlp, cnn, resnet8, resnet20, resnet50, transformer, gpt (nanoGPT's, small), gpt2 (GPT-2 124M's shape), or
    torchvision:<name>."""
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
        return build_dataset(d.dataset, train, d.data_dir, d.synthetic_size, self.parallel.seed, d.block_size,
                             d.token_dtype)

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
        from ..models import build_model  # only where a model is built: not on every config load

        info = dataset_info(self.data.dataset, self.data.data_dir, self.data.block_size, self.data.token_dtype)
        return build_model(self.model, tuple(info["input_shape"]), info["num_classes"])

    def to_dict(self) -> dict[str, Any]:
        """This config as nested plain dicts (a deep copy), as :func:`load_config` reads a file."""
        return dataclasses.asdict(self)
