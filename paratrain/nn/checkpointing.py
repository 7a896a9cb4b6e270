"""Activation checkpointing: keep only each chosen block's inputs in the forward, and recompute its
insides during the backward (``torch.utils.checkpoint``, non-reentrant), trading compute for memory.

The chosen blocks' ``forward`` is replaced on the instance, so the module tree, its parameter names
and its checkpoints' keys stay the user's (no ``_checkpoint_wrapped_module`` prefix), and it
composes with DDP and FSDP2 (applied before sharding, as torchtitan does). RNG state is saved and
restored around the recompute, so dropout masks are the forward's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointPolicy", "checkpoint_policy", "apply_activation_checkpointing"]

CheckpointPolicy = Union[Sequence[Union[str, type]], Callable[[nn.Module], bool]]
"""Block classes (or their names), or a callable saying whether to checkpoint a module."""


def checkpoint_policy(policy: Any) -> Callable[[nn.Module], bool]:
    """The predicate for ``policy``: class names, classes, or a callable ``module -> bool``."""
    if callable(policy) and not isinstance(policy, type):
        return policy  # type: ignore[no-any-return]
    if isinstance(policy, (str, type)):
        policy = [policy]
    names = {p for p in policy if isinstance(p, str)}
    classes = tuple(p for p in policy if isinstance(p, type))
    bad = [p for p in policy if not isinstance(p, (str, type))]
    if bad or not policy:
        raise ValueError(f"activation_checkpointing {policy!r} must name block classes (e.g. ['Block']) or be a "
                         "callable module -> bool")
    return lambda m: type(m).__name__ in names or (bool(classes) and isinstance(m, classes))


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module, policy: Any) -> list[str]:
    """Checkpoint every module of ``model`` the policy chooses (the outermost, when chosen ones
    nest); returns their names. A policy that chooses nothing is an error naming the classes seen."""
    choose = checkpoint_policy(policy)
    chosen: list[str] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(c + ".") for c in inside):
            continue
        if choose(module):
            if getattr(module, "_paratrain_checkpointed", False):
                chosen.append(name)
                inside.append(name)
                continue
            module.forward = functools.partial(_checkpointed, module.forward)  # type: ignore[method-assign]
            module._paratrain_checkpointed = True  # type: ignore[assignment]
            chosen.append(name)
            inside.append(name)
    if not chosen:
        kinds = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise ValueError(f"activation_checkpointing {policy!r} matches no module of {type(model).__name__}: its "
                         f"classes are {', '.join(kinds[:12])}{', ...' if len(kinds) > 12 else ''}")
    return chosen
