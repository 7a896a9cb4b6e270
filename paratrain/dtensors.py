"""DTensor checks that cost nothing where no DTensor can exist.

Importing ``torch.distributed.tensor`` takes about 0.7 s (it pulls in sympy), a quarter of a ``paratrain``
process's start-up, and ddp, single and the parameter server never need it. A process that has not imported
it holds no DTensor, so these checks ask ``sys.modules`` first and import nothing.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["is_dtensor", "local_part"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a sharded or replicated tensor of FSDP2, tensor parallelism or a mesh)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its local shard if it is a DTensor, else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
