"""Synchronized BatchNorm that works on every backend, CPU/gloo included.

``torch.nn.SyncBatchNorm`` only accepts GPU tensors. :class:`SyncBatchNorm` computes the batch
statistics over all ranks of a process group with one differentiable all-reduce, so the result
(output, gradients and running stats) equals ``nn.BatchNorm*`` applied to the concatenated global
batch. :func:`convert_sync_batchnorm` keeps CUDA models on PyTorch's fast NCCL kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "has_unsynced_batchnorm"]


class _AllReduceSum(torch.autograd.Function):
    """``all_reduce(SUM)`` with a gradient: every rank's output depends on every rank's input,
    so the gradient of the input is the sum of all ranks' output gradients (an all-reduce too).
    Every rank must therefore run backward through it, exactly as with ``nn.SyncBatchNorm``."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None]:
        grad = grad_output.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over ``(N, C, *)`` inputs whose training statistics span all ranks of ``process_group``.

    Training with a process group of more than one rank: per-channel sum, sum of squares and count
    are all-reduced in one collective (in float64; the local statistics are computed in float32
    for half-precision inputs and in the input's own dtype for float32 and float64), then the input is normalised with the global mean and biased variance; running stats get
    the global unbiased variance, as ``nn.BatchNorm`` would on the whole batch. Every rank must call
    forward (and backward) the same number of times. Evaluation, or no process group / a world of
    one, runs the plain ``nn.BatchNorm`` code and never communicates. Output has the input's dtype.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of shape (N, C, *), got {input.dim()}D input")

    def _sync_world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: Tensor) -> Tensor:
        if not self.training or self._sync_world_size() <= 1:
            return super().forward(input)  # exactly nn.BatchNorm; no collective
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum

        x = input.to(torch.promote_types(input.dtype, torch.float32))
        c, dims = x.shape[1], [0, *range(2, x.dim())]
        n_local = x.numel() // c if c else 0
        if n_local > 0:  # numerically stable local moments, combined in float64
            var_l, mean_l = torch.var_mean(x, dim=dims, correction=0)
            mean_l, var_l = mean_l.double(), var_l.double()
            s, q = mean_l * n_local, (var_l + mean_l * mean_l) * n_local
        else:  # empty slice on this rank: contributes zeros (still in the graph)
            s = q = x.sum(dims).double()
        stats = _AllReduceSum.apply(torch.cat([s, q, s.new_full((1,), float(n_local))]), self.process_group)
        count = int(stats[2 * c].item())
        if count <= 1:
            raise ValueError(f"expected more than 1 value per channel when training, got {count} over all ranks")
        mean = stats[:c] / count
        var = (stats[c : 2 * c] / count - mean * mean).clamp_min(0.0)

        if self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                rm, rv = self.running_mean, self.running_var
                rm.mul_(1.0 - factor).add_(mean.to(rm.dtype) * factor)
                rv.mul_(1.0 - factor).add_((var * (count / (count - 1))).to(rv.dtype) * factor)

        shape = [1, c] + [1] * (x.dim() - 2)
        scale = torch.rsqrt(var + self.eps).to(x.dtype)
        if self.weight is not None:
            scale = scale * self.weight.to(x.dtype)
        out = (x - mean.to(x.dtype).view(shape)) * scale.view(shape)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype).view(shape)
        return out.to(input.dtype)


def _on_cuda(module: nn.Module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.device.type == "cuda" for t in tensors if not isinstance(t, UninitializedParameter))


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` in ``module`` (recursively) with a synchronized one.

    CUDA models get ``torch.nn.SyncBatchNorm`` (NCCL kernel); any other device gets paratrain's
    :class:`SyncBatchNorm`. The new layers share the original parameters and buffers (so
    ``requires_grad``, the values and an existing optimizer's references carry over) and keep the
    training flag and ``qconfig``. Already-synchronized layers are left as they are. Returns the
    converted module (``module`` itself unless it is a BatchNorm).
    """
    if _on_cuda(module):
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return _convert(module, process_group)


def _convert(module: nn.Module, process_group: Any) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (nn.SyncBatchNorm, SyncBatchNorm)):
        if isinstance(module.weight, UninitializedParameter) or isinstance(
            module.running_mean, UninitializedBuffer
        ):
            raise ValueError("convert_sync_batchnorm needs initialized lazy BatchNorm layers: run one forward first")
        out = SyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
            process_group,
        )
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _convert(child, process_group))
    return out


def has_unsynced_batchnorm(module: nn.Module) -> bool:
    """True when ``module`` holds a BatchNorm layer that is not synchronized across ranks."""
    return any(
        isinstance(m, _BatchNorm) and not isinstance(m, (nn.SyncBatchNorm, SyncBatchNorm))
        for m in module.modules()
    )
