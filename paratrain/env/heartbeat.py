"""Each rank's heartbeat in the job's store: is a rank that did not arrive at a collective alive elsewhere, or silent?

When a rank times out waiting for another (:func:`~paratrain.env.failures.explain_timeout`), the
missing rank is either alive somewhere else (in a collective the others never entered: the
main-process-only mistake; in a long computation) or silent: frozen, gone, or on a host the network
lost. The first is worth waiting for (it times out too, and says where it waited); the second never
answers. A thread in every rank of a gloo group adds 1 to its own counter in the job's store
(``MASTER_ADDR:MASTER_PORT``, the store torchrun's agent or rank 0 serves) every :func:`interval`
seconds; a rank that waits reads the counters of the missing ranks (:class:`Watch`), and one whose
counter stood still for :func:`silent_after` seconds is silent. The thread takes no GIL while it
sleeps or talks to the store, so a rank blocked in a collective or in a long kernel still beats.

NCCL needs none of this: its watchdog aborts the process on its own timeout.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .network import agent_serves_store

__all__ = ["start", "stop", "interval", "silent_after", "Watch"]


def interval(timeout_s: float | None) -> float:
    """Seconds between two beats: a twentieth of the collective timeout, within [0.5, 5] (two store
    requests per rank per 5 s at the default ``timeout_s`` of 600: the beat, and whether the job ended)."""
    return min(5.0, max(0.5, (timeout_s or 10.0) / 20))


def silent_after(timeout_s: float | None) -> float:
    """How long a rank's counter must stand still before it counts as silent: four beats, at least 2 s
    (a busy machine may delay a beat by a few hundred milliseconds)."""
    return max(2.0, 4 * interval(timeout_s))


_groups = 0  # the groups this process beat for: a group's keys never meet a former one's (whose store may be the same)


def _key(rank: int | str) -> str:
    return f"paratrain/alive/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_groups}/{rank}"


_ENDED = "ended"  # set by the rank that serves the store as its beats stop: every heartbeat stops at its next beat
_STOPPED = "stopped"  # how many of the other ranks stopped beating: the serving rank ends once all did


class _Beat(threading.Thread):
    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        super().__init__(name="paratrain-heartbeat", daemon=True)
        self.rank, self.world_size, self.every = rank, world_size, interval(timeout_s)
        self.key, self.ended, self.stopped = _key(rank), _key(_ENDED), _key(_STOPPED)
        self.halt, self.linger = threading.Event(), False
        # rank 0 serves the job's store, unless torchrun's agent does: its process's end ends the store
        self.serves = rank == 0 and not agent_serves_store()
        self.addr, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # rank 0 beats through the store it serves, which keeps its server up while the others beat, after the
        # group is destroyed too (a script's own destroy_process_group())
        self.store = _served_store() if self.serves else None

    def run(self) -> None:
        """Beat until halted, the store's server ends the beats or the store fails. A beat that touches a store
        that is gone makes torch log a C++ stack: so the rank that serves the store ends every beat as it stops its
        own, and waits (``linger``, at most a beat) until the others stopped; a beat that wakes long after it was
        due (a frozen process, resumed to be terminated, while the store may be gone) stops: that rank counts as
        silent from then on."""
        try:
            store = self.store or dist.TCPStore(self.addr, self.port, None, False,
                                                timedelta(seconds=max(5.0, 2 * self.every)), wait_for_workers=False)
            self.store = None  # the thread's own reference: the server (rank 0's) lives as long as the beats
            due = time.monotonic()
            while not self.halt.wait(max(0.0, due - time.monotonic())):
                if time.monotonic() - due > max(2.0, 3 * self.every):  # frozen, resumed (to be terminated, mostly)
                    return
                store.add(self.key, 1)
                if store.check([self.ended]):
                    return
                due = time.monotonic() + self.every
            if not self.serves:
                store.add(self.stopped, 1)
                return
            store.set(self.ended, "1")
            until = time.monotonic() + self.every
            while self.linger and store.add(self.stopped, 0) < self.world_size - 1 and time.monotonic() < until:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is gone or frozen: the job is ending
            pass


def _served_store() -> Any:
    """The store under the default process group's key prefixes (a ``TCPStore``), or None."""
    try:
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        return store if isinstance(store, dist.TCPStore) else None
    except Exception:  # noqa: BLE001 - a private API of torch's: a client of its own then
        return None


_beat: _Beat | None = None


def start(rank: int, world_size: int, timeout_s: float) -> None:
    """Beat for ``rank`` until :func:`stop`, when the job names its store (``MASTER_ADDR``/``MASTER_PORT``); once per
    process (a new group beats under its own rank). The caller stops it: ``env.process`` does as it leaves the group
    (``destroy``, or at the exit, where it knows whether the others may still beat)."""
    global _beat, _groups
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return
    stop()
    _groups += 1
    _beat = _Beat(rank, world_size, timeout_s)
    _beat.start()


def stop(linger: bool = False) -> None:
    """End this process's heartbeat (safe to call when there is none), before its group is destroyed. When this
    process serves the job's store, every rank's beats end too; ``linger`` (the others may still beat: this process
    ends with an error, or without a barrier): it waits until they stopped, at most a beat, before the store ends
    with it."""
    global _beat
    beat, _beat = _beat, None
    if beat is None:
        return
    beat.linger = linger
    beat.halt.set()
    # a store that does not answer keeps it up to its own timeout: a daemon, it ends with this process
    beat.join(timeout=0.5 + (beat.every if linger and beat.serves else 0.0))


class Watch:
    """The counters of the ranks a waiting rank is missing, read through ``store`` as it polls
    (:meth:`look`): :meth:`silent` names those that beat before and stood still for :func:`silent_after`."""

    def __init__(self, timeout_s: float | None) -> None:
        self.after = silent_after(timeout_s)
        self.first: dict[int, int] = {}
        self.moved: set[int] = set()
        self.since: float | None = None

    def look(self, store: Any, ranks: list[int]) -> None:
        if self.since is None:
            self.since = time.monotonic()
        for r in ranks:
            if r in self.moved:
                continue
            n = int(store.add(_key(r), 0))
            if r not in self.first:
                self.first[r] = n
            elif n != self.first[r]:
                self.moved.add(r)

    def silent(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that are known silent now (none before :func:`silent_after` of watching)."""
        if self.since is None or time.monotonic() - self.since < self.after:
            return []
        return [r for r in ranks if self.first.get(r, 0) > 0 and r not in self.moved]
