"""Metrics across processes: ``all_gather`` (variable-size tensors, any picklable object), ``reduce``,
and how :meth:`Parallel.evaluate` reads a batch and a model's output.

``all_gather`` is what metrics that need every prediction use (AUC, BLEU, a confusion matrix):
each rank passes its shard's predictions, every rank gets them all, in rank order. torchmetrics
``Metric`` objects need nothing from here: their ``compute()`` syncs over the default process
group, which is the one paratrain starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather", "reduce", "is_classification", "predictions", "model_loss", "batch_targets", "mapping_loss"]

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}


def _world(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_gather(obj: Any, group: Any = None) -> Any:
    """Every rank's ``obj``, on every rank (a collective: call it on all ranks of ``group``, None:
    the world).

    * a tensor: the ranks' tensors concatenated along dim 0, in rank order; their first
      dimension may differ (an uneven evaluation shard), the others must match. A 0-dim tensor
      gives one value per rank.
    * anything else (picklable): a list with each rank's object, in rank order.

    In a single process: the tensor itself, or ``[obj]``.
    """
    if not isinstance(obj, torch.Tensor):
        if _world(group) == 1:
            return [obj]
        out: list[Any] = [None] * _world(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    tensor = obj.detach()
    if tensor.dim() == 0:
        tensor = tensor[None]
    if _world(group) == 1:
        return tensor
    # Every rank's shape and dtype first: a rank with nothing (an empty evaluation shard) often has
    # torch.empty(0), float32, (0,) where the others have (k, C) int64; it takes theirs.
    shapes: list[Any] = [None] * _world(group)
    dist.all_gather_object(shapes, (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")), group=group)
    filled = [(shape, dtype) for shape, dtype in shapes if math.prod(shape) > 0] or shapes
    trailing, dtype = filled[0][0][1:], getattr(torch, filled[0][1])
    if any(shape[1:] != trailing or kind != filled[0][1] for shape, kind in filled):
        raise ValueError("all_gather: the ranks' tensors differ beyond their first dimension: "
                         + ", ".join(f"rank {r} {tuple(s)} {k}" for r, (s, k) in enumerate(shapes))
                         + "; give every rank the same trailing shape and dtype")
    if tensor.numel() == 0:
        tensor = tensor.new_zeros((0, *trailing), dtype=dtype)
    is_bool = tensor.dtype == torch.bool  # gloo has no bool collectives
    if is_bool:
        tensor = tensor.to(torch.uint8)
    sizes = [shape[0] if math.prod(shape) > 0 else 0 for shape, _ in shapes]
    longest = max(sizes)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(_world(group))]
    dist.all_gather(parts, padded.contiguous(), group=group)
    result = torch.cat([p[:s] for p, s in zip(parts, sizes)])
    return result.bool() if is_bool else result


def reduce(value: Any, op: str = "mean", device: torch.device | None = None, group: Any = None) -> torch.Tensor:
    """``value`` (a tensor or a number) summed, averaged, maxed... over the ranks of ``group``
    (None: all); a new tensor. A Python number is reduced in float64 (or int64).

    ``op``: sum, mean, max, min or product. A collective: call it on all ranks.
    """
    if op not in _OPS:
        raise ValueError(f"reduce op {op!r} is unknown: use one of {', '.join(_OPS)}")
    tensor = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(
        value, device=device, dtype=torch.float64 if isinstance(value, float) else None)
    if op == "mean" and not tensor.is_floating_point():
        tensor = tensor.double()
    is_bool = tensor.dtype == torch.bool  # gloo has no bool collectives
    if is_bool:
        tensor = tensor.to(torch.uint8)
    if _world(group) > 1:
        dist.all_reduce(tensor, op=_OPS[op], group=group)
    tensor = tensor.bool() if is_bool else tensor
    return tensor / _world(group) if op == "mean" else tensor


# --- reading batches and outputs (Parallel.evaluate) ----------------------------------------------
def _get(obj: Any, key: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key)
    if dataclasses.is_dataclass(obj):
        return getattr(obj, key, None)
    return None


def model_loss(output: Any) -> torch.Tensor | None:
    """The loss a model computed itself (HuggingFace's ``output.loss`` when labels were given)."""
    loss = _get(output, "loss")
    return loss if isinstance(loss, torch.Tensor) else None


def predictions(output: Any) -> torch.Tensor | None:
    """The predictions in a model's output: the tensor itself, ``logits``, or a tuple's first."""
    if isinstance(output, torch.Tensor):
        return output
    logits = _get(output, "logits")
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def batch_targets(batch: Any) -> torch.Tensor | None:
    """A dict batch's targets: its ``labels`` (HuggingFace) or ``label`` entry."""
    for key in ("labels", "label"):
        value = _get(batch, key)
        if isinstance(value, torch.Tensor):
            return value
    return None


def mapping_loss(model: Any, batch: Mapping[str, Any], loss_fn: Any) -> torch.Tensor:
    """The loss of a dict batch: ``model(**batch)``'s own (HuggingFace's, when the batch has
    ``labels``), else ``loss_fn(logits, batch["labels"])``."""
    out = model(**batch)
    loss = model_loss(out)
    return loss if loss is not None else loss_fn(predictions(out), batch_targets(batch))


def is_classification(preds: torch.Tensor | None, targets: torch.Tensor | None) -> bool:
    """Integer class targets and logits with one class dimension more, at dim 1 (``(N, C)``,
    ``(N, C, d1...)`` against ``(N, d1...)``), as ``cross_entropy`` reads them.

    One logit per sample (``(N, 1)``, a binary classifier for a BCE loss) is not: its argmax is
    always 0. Logits that also fit with the class dimension last, as a language model's token logits
    ``(N, T, V)`` against ``(N, T)`` do when ``V == T``, are ambiguous: not classification (no
    accuracy, no default loss), rather than an argmax over the wrong dimension."""
    if preds is None or targets is None or not preds.is_floating_point():
        return False
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        return False
    if preds.dim() >= 3 and preds.shape[:-1] == targets.shape:
        return False
    if preds.dim() >= 2 and preds.shape[1] < 2:  # one logit (a binary classifier's): argmax would say 0
        return False
    return preds.dim() == targets.dim() + 1 and preds.shape[:1] + preds.shape[2:] == targets.shape
