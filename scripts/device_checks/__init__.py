"""The GPU-only checks of ``scripts/device_check.sh``, each a short paratrain run compared with a
one-process reference; ``python scripts/device_checks NAME --mode gpu|cpu --result FILE``.

``--mode gpu`` is the check as a GPU machine runs it (CUDA, nccl); ``--mode cpu`` is its CPU twin at
tiny size, what ``device_check.sh --dry-run`` runs (gloo, the CPU's autocast, paratrain's own
SyncBatchNorm, torch.compile with the ``aot_eager`` backend). A check returns a :class:`Result`;
one that raises :class:`CheckFailed` (or anything else) failed, :class:`Skip` skipped with its
reason. Every check prints what it compared, so its log in ``OUT/<check>.log`` shows the numbers.

The driver (``scripts/device_check.py``) imports nothing from here: it runs each check in a process
of its own, with a hard time limit.
"""

from __future__ import annotations

from . import compiled, fp16, fsdp, hangs, nccl, predict, syncbn  # noqa: F401 - each registers its check in CHECKS
from .base import CHECKS, CheckFailed, Result, Skip, check

__all__ = ["CHECKS", "CheckFailed", "Result", "Skip", "check"]
