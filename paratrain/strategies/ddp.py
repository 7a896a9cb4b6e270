"""``ddp``: ``DistributedDataParallel`` — one process per device, gradients all-reduced in buckets.

Options map 1:1 to DDP's arguments; ``comm_hook`` compresses the all-reduce (fp16/bf16) or
replaces it with PowerSGD's low-rank approximation.
"""

from __future__ import annotations

import math
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
    master_weights = True
    plain_data_parallel = True
    comm_hooks = COMM_HOOKS
    bench_default = "quick"

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
        ddp = DDP(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=o.bucket_cap_mb,
            find_unused_parameters=o.find_unused_parameters,
            static_graph=o.static_graph,
            gradient_as_bucket_view=o.gradient_as_bucket_view,
            **extra,
        )
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

    def hidden_comm_bytes_per_step(self, model: nn.Module) -> int:
        # Without a hook the all-reduce runs in DDP's C++ reducer (a hook's collectives are Python calls).
        if self.options.comm_hook != "none" or self.proc.world_size == 1:
            return 0
        return bucket_bytes(model)

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        # What DDP.no_sync() does, as a flag: the caller sets it before each forward (nanoGPT).
        if isinstance(model, DDP) and not self.options.static_graph:
            model.require_backward_grad_sync = enabled


def bucket_bytes(model: nn.Module) -> int:
    """Bytes DDP's built-in reducer all-reduces per synchronising backward (all its buckets)."""
    for m in model.modules():
        if isinstance(m, DDP):
            sizes = str(m._get_ddp_logging_data().get("bucket_sizes", ""))
            return sum(int(s) for s in sizes.replace(" ", "").split(",") if s)
    return 0
