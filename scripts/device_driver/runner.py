"""Running a step: its command in a process group of its own, its output in its log, killed at
its deadline; and the one-line reasons read off a log."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KILL_GRACE", "Outcome", "Runner", "tail_line", "why_not"]

KILL_GRACE = 5.0
"""Seconds between SIGTERM and SIGKILL of a step's process group past its slice."""


@dataclass
class Outcome:
    name: str
    what: str
    status: str  # ok, failed, skipped
    summary: str = ""
    """ok: the result; failed: the one-line reason; skipped: why."""
    seconds: float = 0.0
    slice_s: float | None = None
    command: list[str] = field(default_factory=list)
    log: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- running a step


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Runner:
    """Starts a step's command in a new session (process group), output to its log, and kills the
    whole group at the deadline or when the driver is told to stop."""

    def __init__(self) -> None:
        self.current: subprocess.Popen | None = None
        self.stopping: str | None = None

    def kill(self, proc: subprocess.Popen) -> None:
        for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                proc.wait(wait)
                # the leader is gone; what it started may still be in the group
                os.killpg(proc.pid, signal.SIGKILL)
                return
            except subprocess.TimeoutExpired:
                continue
            except (ProcessLookupError, PermissionError):
                return

    def run(self, cmd: list[str], log_path: str, timeout: float, env: dict[str, str],
            cwd: str) -> tuple[int | None, float]:
        """Exit status (None: killed at the deadline) and seconds."""
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            log.write(f"$ {shlex.join(cmd)}\n# cwd {cwd}; limit {timeout:.0f} s\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=cwd, start_new_session=True, preexec_fn=_die_with_parent)
            self.current = proc
            try:
                proc.wait(timeout=max(0.1, timeout))
                code: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
            finally:
                self.kill(proc)  # past the deadline; or stragglers of a step that ended
                self.current = None
            seconds = time.monotonic() - t0
            log.write(f"\n# {'killed at its limit' if code is None else f'exit {code}'} after {seconds:.1f} s\n")
        return code, seconds

    def stop(self, why: str) -> None:
        self.stopping = why
        if self.current is not None:
            self.kill(self.current)


def tail_line(path: str, pattern: str | None = None) -> str:
    """The last non-empty line of a log (the last one matching ``pattern`` when given), or ''."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("# ")]
    except OSError:
        return ""
    if pattern:
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else ""


def why_not(code: int | None, log: str) -> str:
    """A failed command's one-line reason: its last error line, or its exit status."""
    return "killed at its slice" if code is None else tail_line(log, r"Error|error") or f"exit {code}"
