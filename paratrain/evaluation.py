"""Evaluation over every rank's shard: loss, accuracy and the user's metrics, reduced once.

:meth:`paratrain.Parallel.evaluate` is the public entry; this module holds how a batch becomes
predictions and targets, and how strategies whose forward is a collective (FSDP, tensor,
pipeline) keep every rank in step over uneven or streamed shards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .data.batch import batch_size, map_tensors, to_device
from .data.loaders import EvalLoader
from .metrics import batch_targets, is_classification, model_loss, predictions
from .precision import Precision
from .strategies import Strategy

__all__ = ["evaluate", "to_float32"]


@torch.no_grad()
def evaluate(strategy: Strategy, precision: Precision, device: torch.device, net: nn.Module,
             loader: EvalLoader | Iterable[Any],
             loss_fn: Callable[..., torch.Tensor] | None = None, step_fn: Callable[[nn.Module, Any], Any] | None = None,
             metrics: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Loss, accuracy (classification only) and your ``metrics`` of the unwrapped ``net`` over
    ``loader`` (the whole evaluation set), reduced over ranks; ``count`` is the number of samples
    (what :meth:`paratrain.Parallel.evaluate` returns).

    How a batch becomes predictions and targets:

    * ``step_fn(model, batch)``, if given, returns the batch's mean loss (a scalar tensor)
      or ``(predictions, targets)``;
    * a dict batch is passed as ``model(**batch)``: the output's ``loss`` (HuggingFace
      computes it when the batch has ``labels``) and ``logits`` are used, ``batch["labels"]``
      (or ``"label"``) are the targets;
    * ``(inputs, targets)``: ``model(inputs)``.

    The loss is ``loss_fn(predictions, targets)`` if given, else the model's own, else
    cross-entropy for classification targets (integers, with logits that have a class
    dimension) or mean squared error for float targets of the predictions' shape. ``accuracy``
    is reported only for classification targets. ``metrics`` maps names to functions
    ``fn(predictions, targets)`` returning the batch's mean (averaged over samples), or to
    objects with ``update``/``compute`` (torchmetrics ``Metric``: they sync themselves).

    Data-parallel strategies run the unwrapped module, so no collective happens per batch and
    uneven shards cannot hang. Strategies whose forward is itself a collective (FSDP, tensor,
    pipeline) run the same number of forwards on every rank, padding with batches that are
    not counted. One all-reduce of the sums at the end.
    """
    was_training = net.training
    net.eval()
    metrics = dict(metrics or {})
    stateful = {k: m for k, m in metrics.items() if hasattr(m, "update") and hasattr(m, "compute")}
    for metric in stateful.values():  # this evaluation's samples only (torchmetrics accumulates until reset)
        if hasattr(metric, "reset"):
            metric.reset()
    # loss sum, samples with a loss, correct, targets classified, samples, then each metric's sum
    totals = torch.zeros(5 + len(metrics), dtype=torch.float64, device=device)
    for batch, counted in _batches(strategy, device, loader):
        loss, preds, targets = _step(strategy, precision, net, batch, loss_fn, step_fn)
        if not counted or (loss is None and preds is None):  # padding, or not the last pipeline stage
            continue
        n = len(targets) if targets is not None and targets.dim() else batch_size(batch)
        totals[4] += n
        if loss is not None:
            # A loss over integer targets is a mean over those that count (cross_entropy's and
            # HuggingFace's ignore_index -100; a token-mean for (N, T) labels): weighted by how
            # many there are, not by rows, as batches are cut differently at each world size. A
            # batch with none adds nothing (its mean is NaN). Other targets: by rows.
            weight = n
            if targets is not None and targets.dim() and not targets.is_floating_point() and targets.dtype != torch.bool:
                weight = int((targets != -100).sum())
            if weight:
                totals[0] += loss.detach().double() * weight
                totals[1] += weight
        if is_classification(preds, targets):
            valid = targets != -100  # HuggingFace's ignore_index
            totals[2] += ((preds.argmax(1) == targets) & valid).sum()
            totals[3] += valid.sum()
        for i, (name, metric) in enumerate(metrics.items()):
            if name in stateful:
                metric.update(preds, targets)
            else:
                totals[5 + i] += torch.as_tensor(metric(preds, targets), dtype=torch.float64).to(device) * n
    net.train(was_training)
    strategy.all_reduce_sum(totals)
    sums = totals.tolist()
    result: dict[str, Any] = {}
    if sums[1]:
        result["loss"] = sums[0] / sums[1]
    if sums[3]:
        result["accuracy"] = sums[2] / sums[3]
    result["count"] = int(sums[4])
    for i, (name, metric) in enumerate(metrics.items()):
        if name in stateful:
            value = metric.compute()
            result[name] = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        else:
            result[name] = sums[5 + i] / max(sums[4], 1)
    return result


def _step(strategy: Strategy, precision: Precision, net: nn.Module, batch: Any,
          loss_fn: Callable[..., torch.Tensor] | None,
          step_fn: Callable[[nn.Module, Any], Any] | None) -> tuple[Any, Any, Any]:
    """(loss or None, predictions or None, targets or None) of one evaluation batch."""
    with precision.forward_context():
        if step_fn is not None:
            out = to_float32(step_fn(net, batch))
            if isinstance(out, torch.Tensor):
                return out, None, None
            preds, targets = out
            return (loss_fn(preds, targets) if loss_fn is not None else default_loss(preds, targets)), preds, targets
        if isinstance(batch, Mapping):
            out, targets = _forward_dict(net, batch), batch_targets(batch)
        else:
            out, targets = strategy.eval_forward(net, batch[0]), batch[1]
        if out is None:  # not the last pipeline stage
            return None, None, None
        out = to_float32(out)
    preds = predictions(out)
    loss: torch.Tensor | None
    if loss_fn is not None:
        loss = loss_fn(preds, targets)
    else:
        loss = model_loss(out)
        if loss is None:
            loss = default_loss(preds, targets)
    return loss, preds, targets


def _forward_dict(net: nn.Module, batch: Mapping[str, Any]) -> Any:
    """``net(**batch)``, HuggingFace's way; a model that takes no such keywords is told how to
    evaluate its dict batches instead, in one line."""
    try:
        return net(**batch)
    except TypeError as e:
        if "unexpected keyword argument" not in str(e):
            raise
        keys = ", ".join(map(repr, batch))
        raise TypeError(f"evaluate: a dict batch ({keys}) is passed as model(**batch), HuggingFace's way, and "
                        f"{type(net).__name__} does not take it ({e}): pass step_fn=lambda model, batch: "
                        "(model(batch[<input key>]), batch[<target key>])") from None


def _batches(strategy: Strategy, device: torch.device, loader: EvalLoader | Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """``(batch, counted)``: this rank's batches, then uncounted padding forwards so that every
    rank of a collective-forward strategy runs as many forwards as the busiest one."""
    if not strategy.collective_forward:
        yield from ((batch, True) for batch in loader)
        return
    if not isinstance(loader, EvalLoader):
        raise TypeError(f"evaluate: under strategy {strategy.name} every rank runs as many forwards, which batches made "
                        f"beforehand (a {type(loader).__name__}) cannot promise: pass the dataset or DataLoader itself")
    if loader.stream:  # unknown lengths: agree on each forward (one small all-reduce a batch)
        batches, pad = iter(loader), None
        while True:
            batch = next(batches, None)
            more = torch.tensor([float(batch is not None)], device=device)
            if strategy.all_reduce_max(more).item() == 0:
                return
            if batch is not None:
                pad = map_tensors(lambda t: t[:1] if t.dim() else t, batch)
                yield batch, True
            else:
                pad = pad if pad is not None else _first_sample(device, loader)
                yield pad, False
    n = torch.tensor([len(loader)], device=device)
    strategy.all_reduce_max(n)
    pad = None
    for batch in loader:
        pad = map_tensors(lambda t: t[:1] if t.dim() else t, batch)
        yield batch, True
    if pad is None:  # an empty shard (more ranks than samples) still joins every forward
        pad = _first_sample(device, loader)
    for _ in range(int(n.item()) - len(loader)):
        yield pad, False


def _first_sample(device: torch.device, loader: EvalLoader) -> Any:
    """The evaluation set's first sample as a batch of one, on the device (a padding forward)."""
    return to_device(loader.first_sample(), device)


def to_float32(out: Any) -> Any:
    """Half-precision floating tensors of a model's output in fp32 (float64 stays float64);
    every container keeps its type."""
    return map_tensors(lambda t: t.float() if t.is_floating_point() and t.element_size() < 4 else t, out)


def default_loss(preds: Any, targets: Any) -> torch.Tensor | None:
    """Cross-entropy for classification targets, MSE for float targets shaped like the predictions."""
    if is_classification(preds, targets):
        return nn.functional.cross_entropy(preds, targets)
    if (isinstance(preds, torch.Tensor) and isinstance(targets, torch.Tensor) and targets.is_floating_point()
            and preds.shape == targets.shape):
        return nn.functional.mse_loss(preds, targets)
    return None
