"""Cut a model into consecutive parts at top-level children (shared by ``pipeline`` and ``devices``).

A model can be cut when its forward is its top-level children called in order: any
``nn.Sequential``, or a module written that way (``paratrain.models.TinyTransformer``). Each
part is an ``nn.Sequential`` holding the model's own child modules under their own names, so
parameters are shared (not copied) and a part's ``state_dict`` keys are the model's keys.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import torch
from torch import nn

from .base import NotApplicable

__all__ = ["split_model", "balanced_cuts", "check_sequential", "is_plain_sequential", "parse_split_points",
           "output_tensor"]


def parse_split_points(value: Any, owner: str) -> list[str]:
    """Validate an options' ``split_points``: a list of child names, or ``"a,b"`` from the command line."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{owner} split_points {value!r} must be a list of child module names")
    if len(set(value)) != len(value):
        raise ValueError(f"{owner} split_points {list(value)} name a child twice")
    return list(value)


_NEEDS = ("it needs a model whose forward calls its top-level children in order, each taking the previous one's "
          "tensor (an nn.Sequential): build the embeddings, the blocks and the head as one, or use fsdp or tensor")


def _children(model: nn.Module, owner: str) -> list[tuple[str, nn.Module]]:
    containers = [name for name, m in model.named_children() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    if containers or (hasattr(model, "config") and hasattr(model, "base_model_prefix")):
        why = (f"its child {containers[0]!r} is a {type(getattr(model, containers[0])).__name__}, which has no forward"
               if containers else "its forward returns a HuggingFace output object, not a tensor")
        raise NotApplicable(f"{owner}: cannot cut {type(model).__name__} into stages: {why}; {_NEEDS}")
    direct = [name for name, p in model.named_parameters(recurse=False)]
    if direct:
        raise NotApplicable(
            f"{owner}: {type(model).__name__} has parameters outside its top-level children ({', '.join(direct)}): "
            "move them into a child module so that one part owns them"
        )
    return list(model.named_children())


def output_tensor(out: Any) -> Any:
    """A model output's main tensor: HuggingFace's ``logits`` (or ``last_hidden_state``), a tuple's first."""
    for name in ("logits", "last_hidden_state"):
        if not isinstance(out, torch.Tensor) and getattr(out, name, None) is not None:
            return getattr(out, name)
    return out[0] if isinstance(out, (tuple, list)) else out


def _names(children: Sequence[tuple[str, nn.Module]]) -> str:
    names = [n for n, _ in children]
    return ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")


def balanced_cuts(weights: Sequence[int], n_parts: int) -> list[int]:
    """Start indices of parts 1..n-1 that cut ``weights`` into ``n_parts`` contiguous, non-empty
    groups with the smallest possible largest group sum (ties: the earliest cuts)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest max group sum when the first i items form k groups; cut[k][i]: where group k starts
    best = [[inf] * (n + 1) for _ in range(n_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(n_parts + 1)]
    best[0][0] = 0
    for k in range(1, n_parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(n_parts, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_model(model: nn.Module, n_parts: int, split_points: Sequence[str] = (), owner: str = "pipeline") -> list[nn.Sequential]:
    """Cut ``model`` into ``n_parts`` consecutive ``nn.Sequential`` parts of its top-level children.

    ``split_points`` names the children that start parts 2..n. Without them the children are
    grouped so that parameter counts are as even as possible (each child also counts 1, so
    parameter-free layers are spread too). ``owner`` prefixes error messages.
    """
    children = _children(model, owner)
    if n_parts < 1:
        raise ValueError(f"{owner}: {n_parts} parts must be at least 1")
    if n_parts > len(children):
        unit = "stages (processes)" if owner == "pipeline" else "parts (devices)"
        raise NotApplicable(
            f"{owner}: {n_parts} {unit} but {type(model).__name__} has only {len(children)} top-level "
            f"layers ({_names(children)}): use fewer {unit.split('(')[1][:-1]} or a deeper model"
        )
    if split_points:
        if len(split_points) != n_parts - 1:
            raise ValueError(
                f"{owner}: {len(split_points)} split points {list(split_points)} make {len(split_points) + 1} "
                f"parts, but there are {n_parts}: give {n_parts - 1} split points"
            )
        index = {name: i for i, (name, _) in enumerate(children)}
        for name in split_points:
            if name not in index:
                raise ValueError(
                    f"{owner}: split point {name!r} is not a top-level child of {type(model).__name__}: "
                    f"children are {_names(children)}"
                )
        starts = [index[name] for name in split_points]
        if starts[0] == 0 or any(a >= b for a, b in zip(starts, starts[1:])):
            raise ValueError(
                f"{owner}: split points {list(split_points)} must name children in forward order, "
                f"after the first one ({children[0][0]!r}): children are {_names(children)}"
            )
    else:
        weights = [1 + sum(p.numel() for p in child.parameters()) for _, child in children]
        starts = balanced_cuts(weights, n_parts)
    bounds = [0, *starts, len(children)]
    return [nn.Sequential(OrderedDict(children[a:b])) for a, b in zip(bounds, bounds[1:])]


def is_plain_sequential(model: nn.Module) -> bool:
    """An ``nn.Sequential`` whose forward is ``nn.Sequential.forward``: cutting it is exact."""
    return isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward


@torch.no_grad()
def check_sequential(model: nn.Module, parts: Sequence[nn.Module], x: torch.Tensor, owner: str) -> None:
    """Raise when ``model(x)`` differs from running ``parts`` one after the other (e.g. a forward
    that flattens or adds a skip connection outside its children). Runs in eval mode so that no
    RNG is drawn and no BatchNorm statistic moves; every module's mode is restored after."""
    if is_plain_sequential(model):
        return
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        expected = output_tensor(model(x))
        got = x
        for part in parts:
            got = part(got)
    except Exception as e:  # noqa: BLE001 - a part that cannot take the previous one's output: not sequential
        got, expected = None, e
    finally:
        for m, training in modes:
            m.training = training
    same = (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor) and got.shape == expected.shape
            and torch.allclose(got.float(), expected.float(), rtol=1e-4, atol=1e-5))
    if not same:
        raise NotApplicable(
            f"{owner}: {type(model).__name__}.forward is not its top-level children called in order "
            f"({_names(list(model.named_children()))}), so it cannot be cut into stages: use an nn.Sequential "
            "(e.g. put the flatten in a child nn.Flatten)"
        )
