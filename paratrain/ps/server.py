"""The parameter server's state and its RPC endpoints (``torch.distributed.rpc``).

:class:`ServerState` holds the parameters and a twin of the user's optimizer; one lives in the
server process (:func:`set_server`). Workers call the module-level endpoints on it over RPC
(:func:`push_sync`, :func:`push_async`, :func:`abort`...) through :func:`call_server`, which turns
RPC's multi-line remote tracebacks into one line. Two layouts use it: the ``ps`` strategy behind
``Parallel`` (``paratrain/strategies/ps.py``: rank 0 hosts the server and trains too) and the
dedicated layout in :mod:`paratrain.ps.dedicated` (rank 0 serves and trains nothing).

Modes (:class:`PSOptions`):

* ``sync``: the server waits for every worker's gradient of step ``s``, averages them (in worker
  order, so the result is deterministic), takes one optimizer step and answers all workers with
  the new parameters: the numerics of a one-process loop over the same global batches.
* ``async``: each gradient is applied as soon as it arrives, under a lock (one update at a time).
  A gradient computed on server version ``v`` and applied at version ``w`` has staleness ``w - v``;
  the server counts updates and reports mean/max staleness. Not equal to a one-process loop.

Only parameters travel: buffers (BatchNorm running statistics) stay local to each process.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed.rpc as rpc

__all__ = ["PSOptions", "ServerState", "MODES", "SERVER", "get_server", "set_server", "call_server", "fetch", "finish",
           "push_sync", "push_async", "abort"]


MODES = ("sync", "async")
SERVER = "ps"


@dataclass(kw_only=True)
class PSOptions:
    """Parameter-server settings."""

    mode: str = "sync"
    """sync (all workers' gradients averaged, one optimizer step per global batch) or async (each
    worker's gradient applied on arrival; staleness reported)."""
    rpc_timeout_s: float = 60.0
    """Limit on every RPC and on the server's wait for a message: a dead or hung worker fails the job
    (the rendezvous at startup waits as long as torch's own, for every process to arrive). In sync
    mode a push waits for the slowest rank's push of the same step, so this must also cover the
    longest gap between two steps of any rank (an evaluation, a checkpoint write)."""

    def __post_init__(self) -> None:
        self.mode = str(self.mode).lower()
        if self.mode not in MODES:
            raise ValueError(f"ps mode {self.mode!r} is unknown: use one of {', '.join(MODES)}")
        if not self.rpc_timeout_s > 0:
            raise ValueError(f"ps rpc_timeout_s {self.rpc_timeout_s} must be positive")


class ServerState:
    """The state behind the RPC functions below; one per server process."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, workers: int, mode: str,
                 clip_grad_norm: float | None = None) -> None:
        self.params = params
        self.optimizer, self.workers, self.mode, self.clip_grad_norm = optimizer, workers, mode, clip_grad_norm
        self.lock = threading.Lock()
        self.version = 0  # optimizer steps applied
        self.staleness: list[int] = []
        self.losses: list[float] = []
        self.slots: dict[int, tuple[Any, float, Any]] = {}  # sync: this step's (grads, loss, hyper) per worker
        self.pending: torch.futures.Future = torch.futures.Future()  # sync: answer to this step's pushes
        self.finished: set[int] = set()
        self.error: str | None = None
        self.done = threading.Event()
        self.last_message = time.monotonic()

    def snapshot(self) -> tuple[int, list[torch.Tensor]]:
        # A copy: the response is serialised after the lock is released, while others may step.
        return self.version, [p.detach().clone() for p in self.params]

    def apply(self, grads: list[list[torch.Tensor | None]], hyper: list[dict[str, Any]] | None = None) -> None:
        """Average ``grads`` (one list per worker) into ``.grad``, clip, and take one optimizer step
        with the param groups' hyperparameters ``hyper`` (the pushing worker's lr...) when given.

        Called under ``lock``. An error here fails the whole job (every waiting worker hears it).
        """
        try:
            for i, p in enumerate(self.params):
                got = [t for t in (g[i] for g in grads) if t is not None]
                p.grad = None if not got else torch.stack(got).sum(0).div_(len(grads))
            if self.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
            for group, values in zip(self.optimizer.param_groups, hyper or []):
                group.update(values)
            self.optimizer.step()
        except Exception as e:
            self.fail(f"parameter server: optimizer step {self.version} failed: "
                      f"{traceback.format_exception_only(type(e), e)[-1].strip()}", locked=True)
            raise RuntimeError(self.error) from e
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def fail(self, message: str, locked: bool = False) -> None:
        """Record the job's first error, answer the workers waiting on a sync step with it, stop serving."""
        with contextlib.nullcontext() if locked else self.lock:
            if self.error is None:
                self.error = message
            if not self.pending.done():
                # Returned, not set_exception: RPC (torch 2.13) hands an async_execution future's
                # exception to the caller as a return value anyway; _call raises it.
                self.pending.set_result(RuntimeError(self.error))
        self.done.set()


_SERVER: ServerState | None = None  # this process's server, if it hosts one (the RPC functions reach it here)


def get_server() -> ServerState | None:
    return _SERVER


def set_server(state: ServerState | None) -> None:
    global _SERVER
    _SERVER = state


def _server() -> ServerState:
    assert _SERVER is not None, "this process is not the parameter server"
    _SERVER.last_message = time.monotonic()
    if _SERVER.error is not None:
        raise RuntimeError(_SERVER.error)
    return _SERVER


# --- what workers call on the server (module-level functions: RPC sends them by name) ------------
def fetch() -> tuple[int, list[torch.Tensor]]:
    s = _server()
    with s.lock:
        return s.snapshot()


@rpc.functions.async_execution
def push_sync(worker: int, version: int, grads: list[torch.Tensor | None], loss: float,
               hyper: list[dict[str, Any]] | None = None) -> torch.futures.Future:
    s = _server()
    with s.lock:
        answer = s.pending  # resolved by the last worker of this step
        s.slots[worker] = (grads, loss, hyper)
        s.staleness.append(s.version - version)
        if len(s.slots) == s.workers:
            order = sorted(s.slots)  # deterministic sum, whatever the arrival order
            # Hyperparameters (lr under a scheduler) are the same on every worker in sync mode: the first's.
            s.apply([s.slots[w][0] for w in order], s.slots[order[0]][2])  # on error every worker is told (fail)
            s.losses.append(sum(s.slots[w][1] for w in order) / len(order))
            s.slots.clear()
            s.pending = torch.futures.Future()
            answer.set_result(s.snapshot())
    return answer


def push_async(worker: int, version: int, grads: list[torch.Tensor | None], loss: float,
                hyper: list[dict[str, Any]] | None = None) -> tuple[int, list[torch.Tensor]]:
    s = _server()
    with s.lock:
        s.staleness.append(s.version - version)
        s.apply([grads], hyper)
        s.losses.append(loss)
        return s.snapshot()


def finish(worker: int) -> None:
    s = _server()
    with s.lock:
        s.finished.add(worker)
        if len(s.finished) == s.workers:
            s.done.set()


def abort(worker: int, message: str) -> None:
    assert _SERVER is not None
    _SERVER.fail(f"parameter server: worker rank {worker} failed: {message}")


# --- the entry point -----------------------------------------------------------------------------


def call_server(fn: Callable[..., Any], args: tuple, rank: int, opts: PSOptions) -> Any:
    """``rpc_sync`` to the server, with one-line errors instead of RPC's multi-line remote tracebacks."""
    try:
        out = rpc.rpc_sync(SERVER, fn, args=args)
    except Exception as e:  # a remote error keeps its type, with the server's traceback in the text
        text = str(e)
    else:
        if isinstance(out, Exception):  # a sync step the server failed (see ServerState.fail)
            raise out
        return out
    ours = [line for line in text.splitlines() if line.startswith("RuntimeError: parameter server:")]
    if ours:  # the server failed the job (a worker failed, or its optimizer step): pass its reason on
        raise RuntimeError(ours[-1].removeprefix("RuntimeError: "))
    if "ran for more than set timeout" in text:
        wait = " (sync mode: the server waits for every worker's gradient)" if opts.mode == "sync" else ""
        raise TimeoutError(f"worker rank {rank}: no answer from the parameter server within rpc_timeout_s="
                           f"{opts.rpc_timeout_s}{wait}: a process died or hangs")
    first = next((line for line in text.splitlines() if line.strip()), "")
    raise RuntimeError(f"worker rank {rank}: call to the parameter server failed: {first}")
