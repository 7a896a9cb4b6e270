"""``torch.distributed``'s collective functions, read from one call's arguments: the tensor it
carries, its size, and the process group it runs on.

One table for the two that wrap these functions: the record of every collective
(:mod:`paratrain.trace.recorder`) and ``bench``'s byte counter (:mod:`paratrain.bench.measure`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["COLLECTIVES", "group_name", "group_of", "tensor_of", "nbytes", "total_bytes", "arg"]


def nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def total_bytes(ts: Any) -> int:
    """Bytes of a tensor, or of a (nested) list of tensors."""
    if isinstance(ts, (list, tuple)):
        return sum(total_bytes(t) for t in ts)
    return nbytes(ts)


def arg(args: tuple, kwargs: dict, index: int, *names: str) -> Any:
    """Argument ``index`` of a call, or the keyword one of ``names``."""
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return args[index] if len(args) > index else None


# name -> (position, keyword) of the argument whose size nccl-tests counts (all-reduce, reduce and
# broadcast: the tensor; all-gather: the gathered output; reduce-scatter and all-to-all: the input),
# and the position of its ``group`` argument
COLLECTIVES: dict[str, tuple[int, tuple[str, ...], int]] = {
    "all_reduce": (0, ("tensor",), 2),
    "reduce": (0, ("tensor",), 3),
    "broadcast": (0, ("tensor",), 2),
    "all_gather_into_tensor": (0, ("output_tensor",), 2),
    "all_gather_single": (0, ("output_tensor",), 2),  # FSDP2's gathers (torch 2.13)
    "all_gather": (0, ("tensor_list",), 2),
    "reduce_scatter_tensor": (1, ("input",), 3),
    "reduce_scatter_single": (1, ("input",), 3),  # FSDP2's gradient reduction
    "reduce_scatter": (1, ("input_list",), 3),
    "all_to_all_single": (1, ("input",), 4),
    "all_to_all": (1, ("input_tensor_list",), 2),
    "gather": (0, ("tensor",), 3),
    "scatter": (0, ("tensor",), 3),
    "barrier": (-1, (), 0),  # no tensor: recorded, not counted
    "all_gather_object": (-1, (), 2),
    "broadcast_object_list": (-1, (), 2),
}


def tensor_of(name: str, args: tuple, kwargs: dict) -> Any:
    """The tensor (or list of tensors) that one call of ``torch.distributed.<name>`` carries (None for a barrier)."""
    at, names, _ = COLLECTIVES[name]
    return None if at < 0 else arg(args, kwargs, at, *names)


def group_name(group: Any) -> str:
    """The name torch gives a process group ("" for the default group, ``group=None``)."""
    return "" if group is None else str(getattr(group, "group_name", ""))


def group_of(name: str) -> Callable[[tuple, dict], Any]:
    """The process group (None: the default) of one call of ``torch.distributed.<name>`` from its (args, kwargs)."""
    at = COLLECTIVES[name][2]

    def of(a: tuple, k: dict) -> Any:
        return k.get("group", a[at] if len(a) > at else None)

    return of
