"""Random-number-generator states (python, numpy, torch CPU/CUDA) as plain tensors and lists,
so they load with ``weights_only=True``."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state", "same_rng_state"]


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    keys = np.asarray(keys)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's device
        # every visible GPU: dp and devices draw on several GPUs from one process
        state["cuda_all"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return  # a GPU run resumed on a machine without one: the CPU streams still resume
    if "cuda_all" in state:  # as many GPUs as are here (a run may resume on a smaller machine)
        for index, gpu_state in enumerate(state["cuda_all"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(gpu_state, index)
    elif "cuda" in state:  # a checkpoint written before every GPU was saved
        torch.cuda.set_rng_state(state["cuda"])


def same_rng_state(a: Any, b: Any) -> bool:
    """Whether two :func:`rng_state` values (or parts of them) are the same streams."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_rng_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_rng_state(x, y) for x, y in zip(a, b))
    return bool(a == b)
