"""Nested batches and model outputs: apply a function to every tensor, keeping every container's type.

A batch (or a model's output) is any nesting of tensors in tuples, lists, namedtuples, dicts
(``OrderedDict``, HuggingFace ``BatchEncoding``/``ModelOutput`` included) and dataclasses.
:func:`map_tensors` rebuilds each container as the same type — a ``ModelOutput`` stays a
``ModelOutput`` whose ``.loss`` still works — and leaves non-tensor leaves (strings, ints) alone.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = ["map_tensors", "to_device", "batch_size", "first_tensor"]


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside it; containers keep their type."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if _is_namedtuple(obj):
        return type(obj)(*(map_tensors(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(fn, o) for o in obj]
        return items if type(obj) is list else tuple(items) if type(obj) is tuple else _rebuild_sequence(obj, items)
    if isinstance(obj, Mapping):
        entries = {k: map_tensors(fn, v) for k, v in obj.items()}
        return entries if type(obj) is dict else _rebuild_mapping(obj, entries)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)  # fields with init=False, frozen dataclasses: set, not re-constructed
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, map_tensors(fn, getattr(obj, f.name)))
        return new
    return obj


def _rebuild_sequence(obj: Any, items: list[Any]) -> Any:
    try:
        return type(obj)(items)
    except TypeError:  # a subclass whose constructor takes something else
        return tuple(items) if isinstance(obj, tuple) else items


def _rebuild_mapping(obj: Mapping, items: dict[Any, Any]) -> Any:
    """A copy of ``obj`` (same type, same attributes) holding ``items``.

    A shallow copy whose entries are then replaced keeps what a constructor call would lose or
    refuse: ``ModelOutput`` mirrors each key as an attribute (its ``__setitem__`` sets both),
    ``defaultdict`` its factory, ``BatchEncoding`` its encodings.
    """
    try:
        new = copy.copy(obj)
        for k, v in items.items():
            new[k] = v  # type: ignore[index]
        return new
    except Exception:  # an immutable or exotic mapping: its constructor, else a plain dict
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except Exception:
            return items


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) batch to ``device``; containers keep their type."""
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor found in ``obj`` (depth first, in container order), or ``None``."""
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        if not found:
            found.append(t)
        return t

    map_tensors(visit, obj)
    return found[0] if found else None


def batch_size(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor with a batch dimension (0 if none)."""
    sizes: list[int] = []
    map_tensors(lambda t: sizes.append(len(t)) if t.dim() else None, batch)
    return sizes[0] if sizes else 0
