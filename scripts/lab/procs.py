"""Packages and daemons the lab owns: installs by package name with apt-get (once: an installed
package is not fetched again), and daemons started in the foreground, each marked in its
environment so that :func:`stop_daemons` finds them (and what they started) after a killed run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .hosts import LAB_DIR

MARK = "PARATRAIN_LAB_DAEMON"  # in the environment of every daemon the lab starts and their children
_started: list[subprocess.Popen] = []  # started by this process: reaped by stop_daemons (no zombies)


def install(packages: tuple[str, ...], probe: str) -> float:
    """``apt-get install`` ``packages`` unless the command ``probe`` is already there; seconds taken."""
    if shutil.which(probe):
        return 0.0
    t0 = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    quiet: dict = {"env": env, "capture_output": True, "text": True, "stdin": subprocess.DEVNULL}  # never a prompt
    r = subprocess.run(cmd, **quiet)
    if r.returncode != 0:  # a stale package list: update once and retry
        subprocess.run(["apt-get", "update", "-q"], **quiet)
        r = subprocess.run(cmd, **quiet)
    if r.returncode != 0 or not shutil.which(probe):
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
        raise RuntimeError(f"lab: apt-get install {' '.join(packages)} failed: {tail[0]}")
    return time.monotonic() - t0


def start_daemon(name: str, argv: list[str], user: str | None = None) -> subprocess.Popen:
    """Start ``argv`` in the foreground (its own session), output to ``LAB_DIR/name.out``."""
    LAB_DIR.mkdir(parents=True, exist_ok=True)
    out = open(LAB_DIR / f"{name}.out", "ab")
    proc = subprocess.Popen(argv, env={**os.environ, MARK: name}, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, user=user)
    out.close()
    _started.append(proc)
    time.sleep(0.1)
    if proc.poll() is not None:
        raise RuntimeError(f"lab: {name} exited at once ({proc.returncode}); see {LAB_DIR / (name + '.out')}")
    return proc


def lab_daemons() -> list[int]:
    """Pids of every live process the lab's Slurm or munge started: the daemons (:data:`MARK` in
    their environment), slurmstepd (which rewrites its environment, but keeps slurmd's log under
    ``LAB_DIR`` open) and job steps (``SLURM_JOB_ID`` with the lab's ``SLURM_CONF``). Never this
    process or its ancestors."""
    spared = _ancestors()
    conf = f"SLURM_CONF={LAB_DIR}/slurm/slurm.conf".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            fds = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if (any(v.startswith(f"{MARK}=".encode()) for v in environ)
                or (conf in environ and any(v.startswith(b"SLURM_JOB_ID=") for v in environ))
                or any(fd.startswith(f"{LAB_DIR}/") for fd in fds)):
            found.append(int(entry.name))
    return found


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def stop_daemons(timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, every lab daemon and its descendants. Idempotent."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in lab_daemons():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while lab_daemons() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not lab_daemons():
            break
    for proc in _started:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    _started.clear()
