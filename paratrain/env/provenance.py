"""What produced a run: versions, the user's code commit, the machine, the world, the command.

``paratrain train`` records it in ``result.json`` (``provenance``), so a result can be traced
back and re-run.
"""

from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
import sys
from typing import Any

import torch

from .._version import __version__

__all__ = ["provenance", "git_commit"]


def git_commit(folder: str | None = None) -> str | None:
    """The commit checked out in ``folder`` (default: the working directory), with ``+dirty`` when
    tracked files changed; None outside a git checkout or without git."""
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=folder or os.getcwd(), capture_output=True,  # noqa: E731
                                        text=True, timeout=5)
        head = run("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _devices() -> list[str]:
    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [f"cpu ({os.cpu_count()} cores)"]


def provenance(world: dict[str, Any] | None = None) -> dict[str, Any]:
    """The facts of this process's run: versions of paratrain, torch (and its CUDA), python; the
    git commit of the working directory; host, platform and devices; ``world`` (the layout the
    caller knows); the command line as typed."""
    return {
        "paratrain": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "devices": _devices(),
        "world": world or {},
        "command": os.environ.get("PARATRAIN_COMMAND") or shlex.join([os.path.basename(sys.executable), *sys.argv]),
    }
