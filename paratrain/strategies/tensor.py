"""``tensor``: DTensor tensor parallelism for Linear layers ("layer-wise partitioning").

A pair ``Linear -> activation -> Linear`` is split Megatron-style over the ``tp`` ranks: the first
Linear column-wise (each rank computes a slice of the hidden features), the second row-wise (each
rank multiplies its slice; one all-reduce sums the partial outputs). The activation between them
runs on the local slice, so a pair costs one all-reduce in forward and one in backward, and the
pair's output is the full, replicated tensor — the model returns full logits and the loss is
computed as usual.

With ``tp_size`` smaller than the world size the processes form a 2-D mesh ``(dp, tp)``: tensor
parallel inside each ``tp`` group, then FSDP2 over ``dp``. The ranks of one ``tp`` group see the
same batch, so the data layer shards batches over ``dp`` only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ..env.process import Dist
from ..precision import lookup as precision_class
from .base import NotApplicable, mesh_dimensions
from .fsdp import DTensorStrategy, FSDPOptions, format_bytes, parameter_bytes, shard_model

__all__ = ["TensorOptions", "TensorParallelStrategy", "auto_plan", "model_plan", "expand_plan", "checked_plan",
           "parallel_style", "STYLES"]

STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "colwise_gather_output", "embedding_rowwise")
"""Plan styles, in torch's ``parallelize_module`` terms (HuggingFace's ``base_model_tp_plan`` uses them):
``colwise`` splits a Linear's output features and keeps its output local (the next ``rowwise`` layer
takes those slices); ``rowwise`` splits the input features and all-reduces the output;
``colwise_rep`` (HuggingFace: ``colwise_gather_output``) gathers the output whole; ``rowwise_rep``
takes a whole input (it slices it locally); ``embedding_rowwise`` splits an Embedding's rows. A
``_rep`` layer's output is whole, so it is exact whatever the forward does with it: a fused
projection (nanoGPT's ``c_attn``, split into q, k, v in the forward) is ``colwise_rep``."""


@dataclass(kw_only=True)
class TensorOptions:
    """Tensor-parallel settings."""

    tp_size: int | None = None
    """Processes that split each Linear pair. None: all of them. Must divide the world size;
    the quotient is the data-parallel (FSDP) size."""
    plan: dict[str, str] = field(default_factory=dict)
    """Explicit plan {module name or pattern with ``*``: style} (see ``STYLES``); every colwise
    Linear must feed a rowwise one so the model's output is full. Empty: the model's own plan
    (HuggingFace's ``base_model_tp_plan``), else consecutive Linears paired automatically."""

    def __post_init__(self) -> None:
        if isinstance(self.plan, str):  # from the command line: "0.fc1=colwise,0.fc2=rowwise"
            try:
                self.plan = dict(item.split("=", 1) for item in self.plan.split(",") if item.strip())
            except ValueError:
                raise ValueError(f"tensor plan {self.plan!r} must read name=colwise,name=rowwise") from None
            self.plan = {k.strip(): v.strip() for k, v in self.plan.items()}
        if self.tp_size is not None and self.tp_size < 1:
            raise ValueError(f"tensor tp_size {self.tp_size} must be at least 1")
        for name, style in self.plan.items():
            if style not in STYLES:
                raise ValueError(f"tensor plan[{name!r}] = {style!r} is unknown: use one of {', '.join(STYLES)}")


def auto_plan(model: nn.Module) -> dict[str, str]:
    """Column-wise/row-wise pairs: two Linear children of one module with only parameter-free
    modules (activations) between them, e.g. ``fc1, GELU, fc2`` in an MLP block, where the first's
    output features are the second's input features. A first Linear whose output is k times the
    second's input (a fused projection split into k parts in the forward, nanoGPT's ``c_attn``
    before ``c_proj``) pairs as ``colwise_rep``/``rowwise_rep``: exact whatever the forward does."""
    plan: dict[str, str] = {}
    for prefix, module in model.named_modules():
        children = list(module.named_children())
        i = 0
        while i < len(children):
            a = children[i][1]
            if not isinstance(a, nn.Linear):
                i += 1
                continue
            j = i + 1
            while j < len(children) and not isinstance(children[j][1], nn.Linear) \
                    and not any(True for _ in children[j][1].parameters()):
                j += 1
            b = children[j][1] if j < len(children) else None
            if isinstance(b, nn.Linear) and (a.out_features == b.in_features or a.out_features % b.in_features == 0):
                fused = a.out_features != b.in_features
                plan[f"{prefix}.{children[i][0]}".lstrip(".")] = "colwise_rep" if fused else "colwise"
                plan[f"{prefix}.{children[j][0]}".lstrip(".")] = "rowwise_rep" if fused else "rowwise"
                i = j + 1
            else:
                i = j
    return plan


def model_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's own tensor-parallel plan, module patterns (``*``: any name) to styles: a
    HuggingFace model's ``_tp_plan``, or its ``config.base_model_tp_plan`` under the base model's
    prefix; None for a model without one."""
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, dict) and own:
        return {str(k): str(v) for k, v in own.items()}
    config_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if isinstance(config_plan, dict) and config_plan:
        prefix = getattr(model, "base_model_prefix", "") or ""
        base = getattr(model, prefix, None) if prefix else None
        lead = f"{prefix}." if isinstance(base, nn.Module) and base is not model else ""
        return {lead + str(k): str(v) for k, v in config_plan.items()}
    return None


def expand_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with each ``*`` pattern replaced by the module names it matches (in model order)."""
    names = [n for n, _ in model.named_modules()]
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        if "*" not in pattern:
            out[pattern] = style
            continue
        rx = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        out.update({n: style for n in names if rx.match(n)})
    return out


def checked_plan(model: nn.Module, tp: int, given: dict[str, str] | None = None) -> dict[str, str]:
    """The checked plan for ``model`` split over ``tp`` ranks: ``given`` (``*`` patterns allowed), else
    the model's own (HuggingFace's ``base_model_tp_plan``), else :func:`auto_plan`. A HuggingFace
    model without a plan is refused: its forwards are not followed by pairing Linears up."""
    modules = dict(model.named_modules())
    linears = {n: m for n, m in modules.items() if isinstance(m, nn.Linear)}
    if not linears:
        raise NotApplicable(f"tensor: the model ({type(model).__name__}) has no nn.Linear layer to "
                         "parallelize: use fsdp or ddp")
    own = model_plan(model)
    if given:
        plan = expand_plan(model, given)
    elif own is not None:
        plan = expand_plan(model, own)
    elif _is_huggingface(model):
        first = next(iter(linears))
        raise NotApplicable(
            f"tensor: cannot split {type(model).__name__}'s {first!r}: the model has no tensor-parallel plan "
            f"(config.base_model_tp_plan); give one as tensor={{'plan': {{'{first}': 'colwise', ...}}}} or use fsdp")
    else:
        plan = auto_plan(model)
    if not plan:
        raise NotApplicable(f"tensor: found no Linear -> activation -> Linear pair among {len(linears)} Linear "
                         "layers: give an explicit plan in the tensor options")
    for fqn, style in plan.items():
        if style not in STYLES:
            raise NotApplicable(f"tensor: the plan's style {style!r} for {fqn!r} is not supported: use one of "
                                f"{', '.join(STYLES)}")
        module = modules.get(fqn)
        if isinstance(module, nn.Embedding) and style in ("rowwise", "rowwise_rep", "embedding_rowwise"):
            dim, size = "num_embeddings", module.num_embeddings
        elif isinstance(module, nn.Linear):
            # colwise splits the output features over the tp ranks, rowwise the input features
            dim = "out_features" if style.startswith("colwise") else "in_features"
            size = getattr(module, dim)
        else:
            raise ValueError(f"tensor plan names {fqn!r}, which is not an nn.Linear of the model")
        if size % tp:
            raise NotApplicable(f"tensor: {type(module).__name__} {fqn!r} ({style}) has {dim} {size}, "
                                f"not divisible by tp_size {tp}")
    return plan


def parallel_style(style: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    return RowwiseParallel(input_layouts=Replicate())  # rowwise_rep, embedding_rowwise


def _is_huggingface(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "base_model_prefix")


class TensorParallelStrategy(DTensorStrategy):
    """DTensor tensor parallelism, with FSDP2 on the dp dimension of a 2-D mesh.

    From :class:`~.fsdp.DTensorStrategy`: the in-place wrapping, the optimizer pointed at the
    DTensor parameters, ``no_sync`` for the dp reduction (tp all-reduces are part of the
    computation, they never wait), DTensor-aware clipping and DCP checkpoints.
    """

    name = "tensor"
    bench_default = "full"  # a --quick run stays a couple of minutes on 2 CPU cores
    options_class: ClassVar[type | None] = TensorOptions

    @classmethod
    def validate(cls, cfg: Any) -> None:
        super().validate(cfg)
        if precision_class(cfg.precision).scales_loss and cfg.loss_scale is None:
            raise ValueError(f"precision {cfg.precision} with the dynamic loss scale is not supported with strategy tensor "
                             "(GradScaler cannot unscale tensor-parallel and plain gradients together, nor agree on an "
                             "overflow across the tp group): use bf16-mixed, or a static loss_scale such as 128")

    def __init__(self, dist_info: Dist, sync_batchnorm: bool = False, options: TensorOptions | None = None, **common: Any) -> None:
        super().__init__(dist_info, sync_batchnorm, options or TensorOptions(), **common)
        world = dist_info.world_size
        self.tp = self.options.tp_size or world
        if world % self.tp:
            raise NotApplicable(f"tensor: world size {world} is not divisible by tp_size {self.tp}: "
                             f"use a tp_size that divides {world}")
        self.dp = world // self.tp
        self._mesh: Any = None

    @classmethod
    def layout_for(cls, world: int, options: Any = None) -> dict[str, int]:
        tp = getattr(options, "tp_size", None) or world
        return {"dp_shard": max(1, world // tp), "tp": tp}

    @property
    def tensor_options(self) -> TensorOptions:
        """The ``[parallel.tensor]`` section: the plan."""
        return self.options

    # --- data layout: the ranks of one tp group read the same batch ---------------------------
    @property
    def data_parallel_rank(self) -> int:
        return self.proc.rank // self.tp  # init_device_mesh lays ranks out row-major over (dp, tp)

    @property
    def data_parallel_leader(self) -> bool:
        return self.proc.rank % self.tp == 0

    def comm_dimensions(self) -> dict[str, str]:
        return {**super().comm_dimensions(), **mesh_dimensions(self._mesh, {"dp": "dp_shard"})}

    @property
    def mesh(self) -> Any:
        """The 2-D ``(dp, tp)`` DeviceMesh (either dimension may be 1)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        return self._mesh

    # --- model ----------------------------------------------------------------------------------
    def plan_for(self, model: nn.Module) -> dict[str, str]:
        """The checked plan for ``model`` over this strategy's ``tp`` ranks (:func:`checked_plan`)."""
        return checked_plan(model, self.tp, self.tensor_options.plan)

    def wrap(self, model: nn.Module) -> nn.Module:
        """Split the plan's layers over the ``tp`` ranks, then shard (FSDP2) over the data-parallel ones."""
        plan = self.plan_for(model) if self.splits else {}  # checked even in a world of one: the error shows up early
        if self.proc.backend is None:
            return model
        from torch.distributed.tensor.parallel import parallelize_module

        tp_mesh, dp_mesh = self.split_meshes()
        old = self.swap.before(model)
        if self.tp > 1:
            parallelize_module(model, tp_mesh, {fqn: parallel_style(s) for fqn, s in plan.items()})
        if self.dp > 1:
            shard_model(model, dp_mesh, self.fsdp_options, self.precision)
        self.swap.after(model, old)
        b = parameter_bytes(model)
        if self.proc.is_main_process:
            print(f"{self.describe_split(plan)}; {format_bytes(b['local'])} of {format_bytes(b['full'])} of parameters "
                  f"per rank ({b['fraction']:.0%})")
        return model

    # --- what the mesh strategy (mesh.py) changes: the meshes, the sharding settings, the log line ---
    splits = True  # a plan is needed (tensor: always; mesh: when tp > 1)
    fsdp_options = FSDPOptions()

    def split_meshes(self) -> tuple[Any, Any]:
        """``(tp mesh, data-parallel mesh)``."""
        return self.mesh["tp"], self.mesh["dp"]

    def describe_split(self, plan: dict[str, str]) -> str:
        return f"paratrain tensor: {len(plan)} Linear layers split over tp={self.tp}, dp={self.dp}"

    # --- metrics: sum over dp only (the tp ranks of a group hold the same numbers) ---------------
    @property
    def metrics_group(self) -> Any:
        return self.mesh["dp"].get_group() if self.proc.backend is not None else None

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.proc.backend is not None and self.dp > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.mesh["dp"].get_group())
        return tensor
