"""``ParallelConfig``: how ``Parallel`` (and ``paratrain train``'s ``[parallel]`` table) splits the
work: strategy, precision, batch, seed and each strategy's options section."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import numbers
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from .. import precision as _precision
from .. import strategies as _strategies
from ..data.sampler import BatchPlan
from ..env import defaults as launch_defaults
from ..env.detect import detect_process
from .files import as_integer, from_dict

__all__ = ["ParallelConfig", "BACKENDS", "ACCELERATORS", "over_launch_defaults"]


BACKENDS = ("auto", "gloo", "nccl", "mpi", "xccl", "hccl")
ACCELERATORS = ("auto", "cpu", "cuda", "xpu", "mps")


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

    strategy: str = _strategies.AUTO
    """auto (the default: single in one process, ddp in several), single, dp, ddp, fsdp (sharded data
    parallel, ZeRO-3/ZeRO-2-like) or tensor (Linear layers split over processes, optionally combined
    with fsdp on a 2-D mesh). Also pipeline (one model stage per process), devices (model parts on
    several devices of one process) and ps (parameter server)."""
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
    check_collectives: bool = False
    """Before each collective, compare its op, size and dtype across the ranks of its group and stop at the first
    difference with one line (:mod:`paratrain.trace`): a collective more each, like TORCH_DISTRIBUTED_DEBUG=DETAIL."""
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
            if strategy.options_class is not None and isinstance(section, str) and hasattr(strategy.options_class, "parse"):
                section = strategy.options_class.parse(section)  # --mesh pp=2,dp_shard=2
                setattr(self, name, section)
            if strategy.options_class is not None and isinstance(section, Mapping):
                setattr(self, name, from_dict(strategy.options_class, section, f"parallel.{name}"))
        if self.strategy != _strategies.AUTO and self.strategy not in _strategies.STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r} is unknown: use one of "
                             f"{', '.join([_strategies.AUTO, *_strategies.STRATEGIES])}")
        if isinstance(self.activation_checkpointing, str):  # from the command line: "Block,Layer"
            self.activation_checkpointing = [c.strip() for c in self.activation_checkpointing.split(",") if c.strip()]
        if self.activation_checkpointing is not None:
            from ..nn.checkpointing import checkpoint_policy

            checkpoint_policy(self.activation_checkpointing)  # one-line error for a bad value, before any process starts
        self.precision = _precision.resolve(self.precision)
        for name in ("global_batch", "accumulation", "micro_batch", "seed"):
            setattr(self, name, as_integer(getattr(self, name), name))
        for name in ("sync_batchnorm", "compile", "check_collectives"):
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
        if self.mesh.given and not _strategies.agrees_with_mesh(self.strategy, self.mesh):
            raise ValueError(f"strategy {self.strategy!r} and mesh {self.mesh} are both set: the mesh says the layout "
                             f"({_strategies.describe_layout(self.strategy)}); give one of them")
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
        return config or cls(**over_launch_defaults(options))

    @property
    def strategy_class(self) -> type[_strategies.Strategy]:
        """The class of the configured strategy: ask it what it can do, never compare its name
        (``auto``: the one for this process's world, :meth:`for_world`)."""
        return _strategies.resolve(self._named())

    def strategy_options(self) -> Any:
        """The options section of the configured strategy (``self.ddp`` for ddp...), or None."""
        return self.strategy_class.options_of(self)

    def for_world(self, world: int) -> ParallelConfig:
        """This config on ``world`` processes: ``strategy="auto"`` replaced by the strategy it stands
        for there (:func:`paratrain.strategies.auto`); any other config as it is."""
        if self.mesh.given:
            self.mesh.sizes(world)  # a one-line error for a layout that does not make this world
        if self.strategy != _strategies.AUTO:
            return self
        return dataclasses.replace(self, strategy=self._named(world))

    def _named(self, world: int | None = None) -> str:
        if self.strategy != _strategies.AUTO:
            return self.strategy
        if self.mesh.given:
            return _strategies.for_mesh(self.mesh)
        if world is None:
            world = detect_process().world_size  # the world this process was started in
        return _strategies.auto(world)

    def layout(self, world: int) -> dict[str, int]:
        """The mesh this config lays ``world`` processes out on (``{"dp_shard": 2, "tp": 2}``; :mod:`..strategies.mesh`):
        the ``mesh`` given, else the strategy's shorthand (ddp: ``{"dp_replicate": world}``...)."""
        if self.mesh.given:
            return self.mesh.sizes(world)
        on_world = self.for_world(world)
        return on_world.strategy_class.layout_for(world, on_world.strategy_options())

    def mesh_name(self, world: int) -> str:
        """The layout on ``world`` processes as the run's log and ``result.json`` name it: ``"dp_replicate=2,dp_shard=2"``."""
        from ..strategies.mesh import describe

        return describe(self.layout(world))

    def data_parallel_size(self, world: int) -> int:
        """Data shards for ``world`` processes under the configured strategy (tensor/pipeline share batches)."""
        if self.mesh.given:  # the batch is split over dp_replicate x dp_shard, whichever strategy runs the layout
            from ..strategies.base import data_parallel_size

            return data_parallel_size(self.mesh.sizes(world))
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


_NOTICED: set[str] = set()  # notices printed by this process (a loop building Parallel() again says nothing new)


def over_launch_defaults(options: Mapping[str, Any]) -> dict[str, Any]:
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
