"""Wake a frozen worker that torchrun's agent asked to terminate (:class:`WakeStopped`)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

__all__ = ["WakeStopped"]


class WakeStopped:
    """While torchrun runs, wake (SIGCONT) any worker that is stopped with a SIGTERM pending.

    A frozen worker (SIGSTOP, a stopped debugger) cannot act on the SIGTERM that the agent sends
    when the group fails, and torch 2.13's agent then waits a fixed 30 s before SIGKILL (its
    ``--shutdown-timeout`` does not reach that path). A worker is woken only once it was asked to
    terminate, so a job paused on purpose (``kill -STOP``) stays paused. Linux only (``/proc``).
    """

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paratrain-wake-stopped", daemon=True)

    def __enter__(self) -> "WakeStopped":
        if os.path.isdir(f"/proc/{os.getpid()}/task"):
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for pid in _children():
                if _stopped_with_sigterm_pending(pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGCONT)


def _children(pid: int | None = None) -> list[int]:
    """This process's descendants (workers forked from the forkserver are its grandchildren)."""
    pid = os.getpid() if pid is None else pid
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    for child in (int(p) for p in f.read().split()):
                        pids += [child, *_children(child)]
    return pids


def _stopped_with_sigterm_pending(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    pending = int(status.get("ShdPnd", "0").strip(), 16) | int(status.get("SigPnd", "0").strip(), 16)
    return status.get("State", "").strip().startswith("T") and bool(pending & (1 << (signal.SIGTERM - 1)))
