"""``torch.distributed`` setup and the main-process helpers every DDP script rewrites by hand.

All helpers work before, during and without a process group: outside one they behave as rank 0
of a world of 1, so the same script runs on one device and on many.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from . import failures, heartbeat, uncaught
from .base import CollectiveTimeoutError, PeerLostError, ProcessInfo, UnavailableError, env_int
from .failures import collective_of, explain_failure, explain_peer_loss, explain_timeout
from .uncaught import explain_uncaught
from .detect import detect_process
from .devices import select_backend, select_device
from .network import free_port, gloo_interface, interface_towards, is_loopback, loopback_store, store_init_method

__all__ = [
    "Dist", "OnProcess", "UnavailableError", "free_port", "CollectiveTimeoutError", "PeerLostError", "explain_timeout", "explain_peer_loss", "explain_failure",
    "explain_uncaught", "collective_of", "init", "interface_towards", "is_loopback", "loopback_store", "store_init_method", "die_with_launcher", "destroy", "preload_dynamo", "rank", "world_size",
    "local_rank", "is_main_process", "barrier", "print_once", "save_on_main",
    "main_process_first", "owns_group",
]

@dataclass(frozen=True)
class Dist:
    """The process group this process joined: its position, device and backend."""

    info: ProcessInfo
    device: torch.device
    backend: str | None  # None when the world is one process and no group was created

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.info.rank == 0


class OnProcess:
    """What an object holding its process's :class:`Dist` (``self.dist``) says of the process:
    ``rank``, ``world_size``, ``is_main_process``, ``device``, and ``print`` on the main process
    only. :class:`paratrain.Parallel` is one."""

    dist: Dist

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def is_main_process(self) -> bool:
        return self.dist.is_main_process

    @property
    def device(self) -> torch.device:
        return self.dist.device

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)


_PR_SET_PDEATHSIG = 1


def die_with_launcher() -> bool:
    """Make this worker end when the process that launched it dies (Linux ``PR_SET_PDEATHSIG``).

    A torchrun agent killed by SIGKILL (an OOM kill) cannot stop its workers; without this they
    would train on and keep writing checkpoints into a run directory that a re-run also uses.
    Applied to workers of torchrun/``paratrain run`` and ``paratrain.launch``; a worker forked from
    ``paratrain train``'s forkserver (:data:`AGENT_PID` set) also watches the agent itself. Returns
    whether it was armed.
    """
    if not sys.platform.startswith("linux"):
        return False
    if "TORCHELASTIC_RUN_ID" not in os.environ and "PARATRAIN_SPAWNED" not in os.environ:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    agent = os.environ.get(AGENT_PID, "")
    if os.getppid() == 1 and agent.isdigit() and int(agent) != 1:
        # paratrain's launcher (not PID 1 itself, as it is as a container's command) died before
        # the signal was armed. Under another launcher a parent of PID 1 may be that launcher.
        os.kill(os.getpid(), signal.SIGTERM)
    if agent.isdigit() and int(agent) != os.getppid():
        _end_with(int(agent))
    return True


# Set by paratrain's launchers for their workers: the launching process's pid (torchrun's agent,
# or the process that called paratrain.launch). Workers that fork from a forkserver have the
# forkserver as parent, which PR_SET_PDEATHSIG watches and which lives as long as any worker; they
# also watch the agent.
AGENT_PID = "PARATRAIN_AGENT_PID"
_WATCHED: set[int] = set()


def _end_with(pid: int) -> None:
    """SIGTERM this process when process ``pid`` (the agent) ends: a thread waits on its pidfd."""
    if pid in _WATCHED:
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # the agent is gone already
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): nothing to wait on
        return
    _WATCHED.add(pid)

    def wait() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="paratrain-agent-watch", daemon=True).start()


def preload_dynamo() -> None:
    """Import ``torch._dynamo`` before ``init_process_group``.

    DDP imports ``torch._dynamo``; imported *after* ``init_process_group`` it keeps the group alive
    past ``destroy()``, and gloo's threads can then abort the exiting worker (torch 2.13). Importing
    it first costs nothing extra (DDP would pay for the import anyway). Through ``importlib``: a
    function-local ``import torch._dynamo`` would make ``torch`` a local name of that function.
    """
    importlib.import_module("torch._dynamo")


def init(
    backend: str | None = None,
    timeout_s: float = 600.0,
    accelerator: str = "auto",
) -> Dist:
    """Join the job's process group (when the world is larger than one) and pick the device.

    Reads rank and world size from torchrun/TorchElastic, ``paratrain.launch``, Slurm or OpenMPI,
    or from the process group when the script made one itself (``mp.spawn``). ``timeout_s`` bounds every collective: a rank that never arrives makes the others fail with an
    error after that long instead of hanging forever.
    """
    info = detect_process()
    if dist.is_initialized():
        info = _as_the_group_says(info)
    die_with_launcher()
    device = select_device(info.local_rank, accelerator)
    chosen = select_backend(device, backend)  # also in a world of one: a bad --backend is an error there too
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if info.world_size == 1 and not (dist.is_initialized() and dist.get_world_size() > 1):
        if info.source == "torchelastic" and not dist.is_initialized():
            # `torchrun --nproc-per-node 1 script.py`: the script may call torch.distributed itself
            # (barrier, destroy_process_group), so the group exists; paratrain needs no collective.
            _join(info, device, chosen, timeout_s)
        return Dist(info, device, None)
    if not dist.is_initialized():
        _join(info, device, chosen, timeout_s)
    from ..trace.recorder import start as record_collectives

    record_collectives(info.rank, info.world_size)  # each rank's last collectives (paratrain.trace)
    joined_with = failures.joined_timeout_s()  # None in a group the script made: its ranks' timeouts are unknown
    if joined_with is not None and "gloo" in str(dist.get_backend()):  # who is silent when a collective times out
        heartbeat.start(info.rank, info.world_size, joined_with)  # (NCCL's watchdog aborts the process instead)
    return Dist(info, device, dist.get_backend())


def joined(dist_info: Dist, check_collectives: bool = False) -> None:
    """What a ``Parallel`` of a distributed job sets up once it has joined: a failed collective ends
    with its one-line cause (:func:`~paratrain.env.uncaught.explain_uncaught`), and the record of
    every collective checks each one across the ranks first when ``check_collectives`` (:mod:`paratrain.trace`)."""
    if dist_info.backend is None:
        return
    explain_uncaught()
    from ..trace.recorder import active

    rec = active()
    if rec is not None:
        rec.checking = check_collectives


def _as_the_group_says(info: ProcessInfo) -> ProcessInfo:
    """Where this process is in a process group the script made itself (``mp.spawn`` and
    ``init_process_group(rank=r, world_size=n)``, often with no launcher variables): the group's
    rank and size win over the environment's, whose ``LOCAL_RANK`` may be a parent launcher's. The
    local rank is the rank (one node: the device is ``rank % device count``, as a spawned script
    usually picks)."""
    r, w = dist.get_rank(), dist.get_world_size()
    if (info.rank, info.world_size) == (r, w):
        return info
    return ProcessInfo(
        rank=r, world_size=w, local_rank=r, local_world_size=w,
        node_rank=env_int("GROUP_RANK", 0), master_addr=os.environ.get("MASTER_ADDR", info.master_addr),
        master_port=env_int("MASTER_PORT", info.master_port), source="process group",
    )


def _join(info: ProcessInfo, device: torch.device, chosen: str, timeout_s: float) -> None:
    """``init_process_group`` for this process of the job, its store on loopback when the job is."""
    if info.world_size > info.local_world_size and not os.environ.get("MASTER_ADDR") and is_loopback(info.master_addr):
        # mpirun/mpiexec choose no rendezvous address: every node would wait on its own loopback
        raise ValueError(f"{info.world_size} ranks from {info.source} on several nodes ({info.local_world_size} on this "
                         "one) but MASTER_ADDR is not set: export MASTER_ADDR=<rank 0's host> and pass it to every "
                         "rank (mpirun -x MASTER_ADDR)")
    preload_dynamo()
    os.environ.setdefault("MASTER_ADDR", info.master_addr)
    os.environ.setdefault("MASTER_PORT", str(info.master_port))
    if chosen == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        ifname = gloo_interface(os.environ["MASTER_ADDR"], info.world_size > info.local_world_size)
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # lets NCCL bind eagerly and fail fast on a bad rank
    failures.remember_timeout(timeout_s)
    timeout = timedelta(seconds=timeout_s)
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store = loopback_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.rank,
                               info.world_size, timeout)
        dist.init_process_group(
            backend=chosen,
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            **({"store": store} if store is not None else {"init_method": "env://"}),
            **kwargs,
        )
        explain_uncaught()  # also notes an uncaught exception, so that the exit does not wait for peers
        global _created
        _created = dist.group.WORLD  # paratrain's own: destroy() and the exit leave it, and only it
        atexit.register(_leave_at_exit, chosen)
    except dist.DistError as e:  # the store: not every rank joined, rank 0's cannot be reached, a port in use
        first = " ".join(str(e).split("Exception raised from")[0].split())[:300]
        what = f"rank {info.rank} of {info.world_size} ({info.source}) could not form the process group at {where}"
        if "in use" in first.lower():
            raise UnavailableError(f"{what}: {first}: another job uses the port; choose another MASTER_PORT") from e
        if isinstance(e, dist.DistStoreError) or "timed out" in first.lower():
            raise CollectiveTimeoutError(
                f"{what} within {timeout_s:g} s (timeout_s): {first}: a rank did not start, or cannot reach {where}; "
                f"start all {info.world_size} with the same MASTER_ADDR/MASTER_PORT") from e
        raise CollectiveTimeoutError(f"{what}: {type(e).__name__}: {first}") from e


# The default process group paratrain created (init joined the job), or None: the only one it
# destroys. A group that was there before (the script's own init_process_group, Ray Train's) stays
# for its owner to destroy.
_created: Any = None


def owns_group() -> bool:
    """Whether the current default process group is one paratrain created (:func:`init`)."""
    return _initialized() and _created is not None and dist.group.WORLD is _created


def destroy(wait_for_peers: bool = False) -> None:
    """Leave the process group paratrain created (safe to call when there is none). A group the
    script (or Ray Train) made before :func:`init` is left as it is, for its owner to destroy.

    ``wait_for_peers`` (for a clean finish) first runs a barrier, so every collective in flight
    has completed and its buffers are freed. Otherwise (torch 2.13, gloo) the process group can be
    destroyed later, from a DDP reducer's destructor that holds the GIL, while a gloo thread waits
    for the GIL to free a finished all-reduce's tensors: a deadlock at exit. Do not wait after an
    error: peers may never arrive.
    """
    if dist.is_available() and dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
            heartbeat.stop()  # every rank stops beating after the barrier: rank 0 need not wait for them
            _let_gloo_threads_finish()
        heartbeat.stop(linger=True)
        if owns_group():
            global _created
            dist.destroy_process_group()
            _created = None  # nor keep it: it holds the group's store, whose port a new group of this process binds


def _let_gloo_threads_finish() -> None:
    """Hold no GIL for a moment, so that gloo's worker threads can drop the collectives they
    finished. Each such work holds the Python context torch 2.13 stashes during ``backward``
    (``torch.autograd.graph._engine_run_backward``); freeing it takes the GIL, and a gloo thread
    that asks for the GIL once the interpreter is finalizing is ended by ``pthread_exit`` inside
    a C++ destructor: ``terminate called without an active exception``, exit code 134."""
    time.sleep(0.05)


_EXIT_WAIT_S = 60.0  # the most a finished rank waits at exit for its peers to finish too


def _leave_at_exit(backend: str) -> None:
    """At the exit of a script that did not call ``Parallel.close``/``destroy``: leave the group
    paratrain joined. Without it a gloo rank that ends while a peer still uses their connection
    dies at exit with SIGABRT ("terminate called without an active exception": 2 runs in 5 of a
    plain torchrun + gloo script, torch 2.13 and 2.14). So after a normal end, gloo ranks first
    meet in torch's ``monitored_barrier``, bounded by ``_EXIT_WAIT_S``: a peer that failed, or is
    still busy (main-process-only work), costs at most that, never a hang. After an exception no
    rank waits. NCCL ranks only destroy the group, as torch asks.

    A script that destroyed the group itself (``dist.destroy_process_group()`` at its end) leaves
    DDP holding it, and gloo's threads may still be freeing its last collectives: the exit gives
    them the GIL first (:func:`_let_gloo_threads_finish`; 1 run in 10 ended with SIGABRT without)."""
    if not owns_group():  # destroyed by the script (or replaced by its own group)
        heartbeat.stop(linger=True)
        if backend == "gloo":
            _let_gloo_threads_finish()
        return
    try:
        gloo = dist.get_backend() == "gloo"
        alone = uncaught.uncaught_seen() or not gloo  # the others may still beat (paratrain.env.heartbeat)
        if not alone:
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=_EXIT_WAIT_S), wait_all_ranks=True)
            except RuntimeError:  # a peer failed or is still busy: leave without it
                alone = True
            _let_gloo_threads_finish()  # as close() does: the last collectives' works are freed before finalizing
        heartbeat.stop(linger=alone)
        dist.destroy_process_group()
        if gloo:
            _let_gloo_threads_finish()
    except Exception as e:  # noqa: BLE001 - this rank's own end is what matters here
        print(f"paratrain: leaving the process group at exit: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
              file=sys.stderr, flush=True)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank (0 outside a process group)."""
    return dist.get_rank() if _initialized() else detect_process().rank


def world_size() -> int:
    """Number of processes in the job (1 outside a process group)."""
    return dist.get_world_size() if _initialized() else detect_process().world_size


def local_rank() -> int:
    """Rank of this process on its node."""
    return detect_process().local_rank


def is_main_process() -> bool:
    """True on global rank 0: the process that prints, logs and saves."""
    return rank() == 0


def barrier() -> None:
    """Wait for every process (no-op outside a process group)."""
    if _initialized():
        dist.barrier()


def print_once(*args: Any, **kwargs: Any) -> None:
    """``print`` on the main process only."""
    if is_main_process():
        builtins.print(*args, **kwargs)


def save_on_main(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` on the main process only, atomically (temp file, then rename)."""
    if is_main_process():
        tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
        torch.save(obj, tmp)
        os.replace(tmp, path)


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Let rank 0 run the block first (download, preprocess, cache), then the others."""
    if not is_main_process():
        barrier()
    try:
        yield
    finally:
        if is_main_process():
            barrier()
