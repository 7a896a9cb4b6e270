"""The one-line errors for a setup or a first backward that would train wrong: ``setup``'s
arguments out of order or of the wrong kind, a model set up twice, an optimizer over another
model's parameters, a DataLoader given to ``setup``, and a loss that no set-up model computed."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .wrappers import ParallelModule, uncompiled

__all__ = ["check_first_backward", "check_setup_arguments"]


def check_setup_arguments(model: Any, optimizer: Any, scheduler: Any, models: Sequence[nn.Module] = ()) -> None:
    """setup(model, optimizer, scheduler) in that order and of those kinds, a model not set up
    before (one of ``models``, what the strategy made of each) and an optimizer over its parameters;
    else a one-line error."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"setup: the model is a {type(model).__name__}, not a torch.nn.Module")
    if isinstance(uncompiled(model), ParallelModule):
        raise ValueError("setup: this model is what pt.setup returned, already set up: set up each model once "
                         "(model, optimizer = pt.setup(model, optimizer)) and use what it returned")
    held = {id(p) for m in models for p in m.parameters()}
    if any(id(p) in held for p in model.parameters()):
        raise ValueError(f"setup: this {type(model).__name__} was set up before (its parameters are a set-up "
                         "model's): set up each model once and use what pt.setup returned")
    if isinstance(optimizer, torch.optim.Optimizer):
        own = {id(p) for p in model.parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if params and not any(id(p) in own for p in params):
            raise ValueError(f"setup: the optimizer holds none of this {type(model).__name__}'s parameters (it was "
                             f"built on another model, or on a copy): build it on this model's, "
                             f"{type(optimizer).__name__}(model.parameters(), ...), then pt.setup(model, optimizer)")
    loaders = [name for name, value in (("optimizer", optimizer), ("scheduler", scheduler))
               if isinstance(value, torch.utils.data.DataLoader)]
    if loaders:  # Accelerate's prepare(model, optimizer, loader): here a loader has its own call
        raise TypeError(f"setup: the {loaders[0]} is a DataLoader: set up the model, optimizer and scheduler with "
                        "pt.setup, and pass the loader to pt.train_loader(loader) (pt.eval_loader for evaluation), "
                        "which shards it over the ranks in global batches of global_batch samples")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        hint = " (a scheduler? pass pt.setup(model, optimizer, scheduler))" if hasattr(optimizer, "optimizer") else ""
        raise TypeError(f"setup: the optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer{hint}")
    if scheduler is not None and not (callable(getattr(scheduler, "step", None)) and hasattr(scheduler, "optimizer")):
        raise TypeError(f"setup: the scheduler {scheduler!r} is not an LR scheduler (one with step() and an "
                        "optimizer, as torch.optim.lr_scheduler's)")
    if optimizer is None and scheduler is not None:
        raise ValueError("setup got a scheduler but no optimizer: pass both, pt.setup(model, optimizer, scheduler)")


def check_first_backward(loss: torch.Tensor, models: list[nn.Module], steps_before: int, sharded: bool) -> None:
    """At a run's first backward (``steps_before`` 0: no backward or optimizer step before), the
    loss must come from a model ``setup`` returned (one of ``models``, what the strategy made of
    each): else its gradients would never be reduced and the replicas would drift apart. A
    one-line error names the fix. Under a strategy that shards the parameters (``sharded``: its
    forward runs on gathered copies, which the graph reaches instead) only a run without a model
    set up is refused."""
    if steps_before:
        return
    fix = "set up the model and its optimizer, model, optimizer = pt.setup(model, optimizer), and compute the loss " \
          "with the model it returns"
    if not models:
        raise ValueError(f"pt.backward: no model was set up, so nothing keeps the processes' replicas equal: {fix}")
    if not sharded and loss.grad_fn is not None and not _reaches(loss.grad_fn, {id(p) for m in models for p in m.parameters()}):
        raise ValueError(f"pt.backward: the loss depends on no parameter of a model pt.setup returned (a model "
                         f"never set up?): {fix}")


def _reaches(node: Any, params: set[int]) -> bool:
    """Whether the autograd graph from ``node`` accumulates a gradient into one of ``params`` (ids)."""
    seen, todo = set(), [node]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if id(getattr(node, "variable", None)) in params:
            return True
        todo.extend(next_node for next_node, _ in node.next_functions)
    return False
