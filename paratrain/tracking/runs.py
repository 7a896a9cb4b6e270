"""Run folders: ``runs/<name or start time>/``, and ``runs/latest``, a link to the newest one."""

from __future__ import annotations

import contextlib
import os
import time
import warnings

__all__ = ["new_run_dir", "link_latest", "latest_run", "LATEST"]

LATEST = "latest"


def new_run_dir(root: str = "runs", name: str | None = None) -> str:
    """``<root>/<name>``, or ``<root>/<start time>`` (``20250101-120000``, then ``-2``, ``-3``... when
    two runs start in the same second); created, and ``<root>/latest`` pointed at it."""
    os.makedirs(root, exist_ok=True)
    if name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name, n = stamp, 1
        while True:
            try:
                os.mkdir(os.path.join(root, name))  # atomic: two runs in one second get two folders
                break
            except FileExistsError:
                n += 1
                name = f"{stamp}-{n}"
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    link_latest(path)
    return path


def link_latest(run_dir: str) -> None:
    """Point ``<parent of run_dir>/latest`` at ``run_dir`` (a relative link, replaced atomically)."""
    root, name = os.path.split(os.path.abspath(run_dir))
    if name == LATEST:
        return
    link = os.path.join(root, LATEST)
    if os.path.isdir(link) and not os.path.islink(link):
        warnings.warn(f"{link} is a folder (a run of an older paratrain), not a link: rename it to get "
                      f"{link} pointing at the newest run", stacklevel=2)
        return
    tmp = f"{link}.tmp-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    try:
        os.symlink(name, tmp)
    except OSError:  # a filesystem without links (vfat, some SMB mounts, Windows without developer mode)
        warnings.warn(f"cannot make the link {link} here (no symbolic links on this filesystem): --resume needs "
                      f"the run's folder, --resume {run_dir}", stacklevel=2)
        return
    os.replace(tmp, link)


def latest_run(root: str = "runs") -> str | None:
    """The run ``<root>/latest`` points at (``<root>/<name>``), or None when there is none."""
    link = os.path.join(root, LATEST)
    if os.path.islink(link):
        target = os.path.join(root, os.readlink(link))
        return target if os.path.isdir(target) else None
    return link if os.path.isdir(link) else None
