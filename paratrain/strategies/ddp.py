"""``ddp``: ``DistributedDataParallel`` — one process per device, gradients all-reduced in buckets.

Options map 1:1 to DDP's arguments; ``comm_hook`` compresses the all-reduce (fp16/bf16) or
replaces it with PowerSGD's low-rank approximation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..env.process import Dist
from .base import Strategy

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass(kw_only=True)
class DDPOptions:
    """DistributedDataParallel settings."""

    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB: larger buckets mean fewer, bigger all-reduces."""
    find_unused_parameters: bool = False
    """Set when some parameters get no gradient in a step (costs a graph traversal per step)."""
    static_graph: bool = False
    """Promise the set of used parameters never changes: lets DDP skip per-step bookkeeping. With
    accumulation every micro-step then all-reduces (the same sum): torch's DDP fails in a backward
    without sync under static_graph (pytorch#143580)."""
    gradient_as_bucket_view: bool = False
    """Gradients alias the communication buckets: saves one copy and memory."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers (e.g. BatchNorm running stats) before every forward."""
    comm_hook: str = "none"
    """Gradient compression: none, fp16, bf16 or powersgd."""
    powersgd_rank: int = 1
    """PowerSGD's matrix approximation rank."""
    powersgd_start_iter: int = 2
    """Plain all-reduce for the first iterations, PowerSGD after (again after a resume: PowerSGD's
    per-rank error feedback is not checkpointed)."""

    def __post_init__(self) -> None:
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"ddp comm_hook {self.comm_hook!r} is unknown: use one of {', '.join(COMM_HOOKS)}")
        if not (math.isfinite(self.bucket_cap_mb) and self.bucket_cap_mb > 0):
            raise ValueError(f"ddp bucket_cap_mb {self.bucket_cap_mb} must be positive")
        if self.powersgd_rank < 1:
            raise ValueError(f"ddp powersgd_rank {self.powersgd_rank} must be at least 1")
        if self.powersgd_start_iter < 2:  # torch's error feedback and warm start need a plain first step
            raise ValueError(f"ddp powersgd_start_iter {self.powersgd_start_iter} must be at least 2")


class DDPStrategy(Strategy):
    name = "ddp"
    whole_layers = True
    master_weights = True
    plain_data_parallel = True
    comm_hooks = COMM_HOOKS
    bench_default = "quick"
    options_class = DDPOptions

    def __init__(self, dist_info: Dist, sync_batchnorm: bool = False, options: DDPOptions | None = None, **common: Any) -> None:
        super().__init__(dist_info, sync_batchnorm, options or DDPOptions(), **common)

    def adopt(self, model: nn.Module) -> nn.Module | None:
        """The user's own ``DistributedDataParallel`` (a script converted line by line) is kept
        with its settings; paratrain adds the data, accumulation and checkpoints around it."""
        return model if isinstance(model, DDP) else super().adopt(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.proc.backend is None:
            return model  # a world of one: DDP would only add overhead
        o: DDPOptions = self.options
        # broadcast_buffers is passed only to turn it off: newer torch warns that it is deprecated.
        extra: dict[str, Any] = {} if o.broadcast_buffers else {"broadcast_buffers": False}
        try:
            ddp = ddp_class()(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                bucket_cap_mb=o.bucket_cap_mb,
                find_unused_parameters=o.find_unused_parameters,
                static_graph=o.static_graph,
                gradient_as_bucket_view=o.gradient_as_bucket_view,
                **extra,
            )
        except RuntimeError as e:  # DDP compares the model across ranks first: a different one fails here
            why = explain_model_mismatch(e, model)
            if why is None:
                raise
            raise why from e
        self._register_comm_hook(ddp, o)
        return ddp

    @staticmethod
    def _register_comm_hook(ddp: DDP, o: DDPOptions) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if o.comm_hook == "fp16":
            ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
        elif o.comm_hook == "bf16":
            ddp.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
        elif o.comm_hook == "powersgd":
            # powerSGD_hook, not batched_powerSGD_hook: the batched variant is broken upstream.
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=o.powersgd_rank,
                start_powerSGD_iter=o.powersgd_start_iter,
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            from ..trace.recorder import active, ddp_hook

            if active() is not None:  # DDP's own all-reduce (C++), recorded: the same sum, scaled the same way
                ddp.register_comm_hook(ddp.process_group, ddp_hook)

    def hidden_comm_bytes_per_step(self, model: nn.Module) -> int:
        # Without a hook the all-reduce runs in DDP's C++ reducer (a hook's collectives are Python calls).
        if self.options.comm_hook != "none" or self.proc.world_size == 1:
            return 0
        return bucket_bytes(model)

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        # What DDP.no_sync() does, as a flag: the caller sets it before each forward (nanoGPT).
        if isinstance(model, DDP) and not self.options.static_graph:
            model.require_backward_grad_sync = enabled


class DDPModelError(ValueError, RuntimeError):
    """DDP cannot reduce this model's gradients as it is set up: parameters that got no gradient, or a
    model that differs between ranks. One line that names paratrain's option or the cause; torch's
    own error (a paragraph about ``DistributedDataParallel``'s arguments) is its ``__cause__``. A
    ``ValueError`` (a user error: ``paratrain train`` prints its line) and the ``RuntimeError`` torch raised."""


class NamesUnusedParameters:
    """Mixed into torch's ``DistributedDataParallel``: its own failures in forward name paratrain's option.

    DDP notices parameters that got no gradient in a backward only at the next forward (its
    reduction never finished); its error tells the user to pass ``find_unused_parameters=True``
    to a ``DistributedDataParallel`` they never constructed. Here it becomes a one-line
    :class:`DDPModelError` that names the parameters and ``ddp={"find_unused_parameters": True}``."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*inputs, **kwargs)  # type: ignore[misc]
        except RuntimeError as e:
            why = explain_unused_parameters(e, self)  # type: ignore[arg-type]
            if why is None:
                raise
            raise why from e


_DDP_CLASSES: dict[type, type] = {}


def ddp_class() -> type:
    """``DDP`` (torch's ``DistributedDataParallel``, looked up when called: a test may stand in for
    it) with :class:`NamesUnusedParameters` mixed in."""
    base = DDP
    if base not in _DDP_CLASSES:
        _DDP_CLASSES[base] = type("ParatrainDDP", (NamesUnusedParameters, base), {"__module__": __name__})
    return _DDP_CLASSES[base]


_UNUSED = "Expected to have finished reduction in the prior iteration"
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")
_UNUSED_NAMES = re.compile(r"Parameters which did not receive grad for rank (\d+): ([^\n]+)")
_COUNT_MISMATCH = re.compile(r"DDP expects same model across all ranks, but Rank (\d+) has (\d+) params, "
                             r"while rank (\d+) has inconsistent (\d+) params")
_SHAPE_MISMATCH = re.compile(r"params\[(\d+)\] in this process with sizes (\[[^\]]*\]) appears not to match "
                             r"sizes of the same param in process (\d+)")


def reduced_parameter_names(module: nn.Module, ignored: Any = ()) -> list[str]:
    """The names of the parameters DDP reduces, in its reducer's order (what the indices in its
    errors count): per module in ``named_modules`` order, its own trainable parameters, each once."""
    names, seen = [], set()
    for prefix, sub in module.named_modules():
        for name, param in sub.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if param.requires_grad and full not in ignored and id(param) not in seen:
                seen.add(id(param))
                names.append(full)
    return names


def _listed(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def explain_unused_parameters(error: BaseException, ddp: DDP) -> DDPModelError | None:
    """If ``error`` is DDP's "Expected to have finished reduction in the prior iteration", a
    :class:`DDPModelError` naming the parameters that got no gradient and what to do (else None)."""
    text = str(error)
    if not isinstance(error, RuntimeError) or _UNUSED not in text:
        return None
    names = reduced_parameter_names(ddp.module, getattr(ddp, "parameters_to_ignore", ()))
    found = _UNUSED_INDICES.search(text)
    rank = found.group(1) if found else None
    unused = [names[int(i)] if int(i) < len(names) else f"#{i}" for i in found.group(2).split()] if found else []
    if not unused and (by_name := _UNUSED_NAMES.search(text)):
        rank, unused = by_name.group(1), [n.strip() for n in by_name.group(2).split(",") if n.strip()]
    which = f"parameters {_listed(unused)}" if unused else "some parameters"
    on = f" on rank {rank}" if rank is not None else ""
    if getattr(ddp, "find_unused_parameters", False):
        return DDPModelError(
            f"{which} got no gradient in the previous backward{on}, with ddp find_unused_parameters on: an output of "
            "forward took no part in the loss (every output must), or DDP cannot find the output tensors in what "
            "forward returns (return tensors, or tuples/lists/dicts of them)")
    return DDPModelError(
        f"{which} got no gradient in the previous backward{on}, and DDP waits for every parameter's gradient: pass "
        'ddp={"find_unused_parameters": True} to paratrain.Parallel (parallel.ddp.find_unused_parameters=true in a '
        "config or --set), or make every parameter take part in the loss")


def explain_model_mismatch(error: BaseException, module: nn.Module) -> DDPModelError | None:
    """If ``error`` is DDP's check at construction that every rank has the same parameters, a
    :class:`DDPModelError` that says how the model differs (else None)."""
    text = str(error)
    same = ("DDP needs the same model on every rank: build it the same way everywhere (no sizes or layers that depend "
            "on the rank), and load the same checkpoint on all")
    if count := _COUNT_MISMATCH.search(text):
        mine, n_mine, other, n_other = count.groups()
        return DDPModelError(f"the model differs between ranks: rank {mine} has {n_mine} trainable parameter tensors, "
                             f"rank {other} has {n_other}; {same}")
    if shape := _SHAPE_MISMATCH.search(text):
        index, size, other = shape.groups()
        names = reduced_parameter_names(module, getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        name = names[int(index)] if int(index) < len(names) else f"#{index}"
        here = f"rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else "this rank"
        return DDPModelError(f"the model differs between ranks: parameter {name} has shape {size} on {here} but "
                             f"another on rank {other}; {same}")
    return None


def bucket_bytes(model: nn.Module) -> int:
    """Bytes DDP's built-in reducer all-reduces per synchronising backward (all its buckets)."""
    for m in model.modules():
        if isinstance(m, DDP):
            sizes = str(m._get_ddp_logging_data().get("bucket_sizes", ""))
            return sum(int(s) for s in sizes.replace(" ", "").split(",") if s)
    return 0
