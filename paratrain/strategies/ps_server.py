"""The parameter server over ``torch.distributed.rpc`` (seed 003), and its dedicated layout.

:class:`ServerState` holds the parameters and the optimizer; the module-level functions below are
what workers call on it over RPC. Two layouts use it: the ``ps`` strategy behind ``Parallel``
(``strategies/ps.py``: rank 0 hosts the server and trains too) and, here,
:func:`run_parameter_server` (seed 003's): rank 0 is a dedicated server that trains nothing, ranks
1..N-1 are workers, each pulling the parameters, computing a gradient on its shard of the data
and pushing it back. Every process calls the same function; the launcher is ``paratrain.launch``
or ``paratrain run`` (torchrun), as for the other strategies::

    def main(local_rank):
        return run_parameter_server(
            lambda: MLP(), lambda params: torch.optim.SGD(params, lr=0.05), trainset,
            global_batch=64, steps=200, mode="sync")

    server, *workers = paratrain.launch(main, nprocs=3)      # 1 server + 2 workers
    model.load_state_dict(server.state_dict)

Modes (:class:`PSOptions`):

* ``sync``: the global batch is split over the workers exactly as ``GlobalBatchSampler`` splits it
  for DDP (epoch permutation by ``(seed, epoch)``, worker ``r`` takes slice ``r - 1``). The server
  waits for every worker's gradient of step ``s``, averages them (in worker order, so the result is
  deterministic), takes one optimizer step and answers all workers with the new parameters. The
  parameters equal a one-process loop over the same global batches (``tests/test_ps.py``).
* ``async``: each gradient is applied as soon as it arrives, under a lock (one update at a time,
  Hogwild-style otherwise: no worker waits for another). A worker's gradient was computed on the
  parameters of some server version; *staleness* = versions applied since then. The server counts
  updates (``workers × steps``) and reports mean/max staleness. Not equal to a one-process loop.

Only parameters travel: buffers (BatchNorm running statistics) stay local to each process. The
server keeps the model on the CPU; workers compute on their device (CUDA when present) and send
CPU gradients. The data set is read by workers only; every process builds the model with
``model_fn()`` after seeding with ``seed``, and the workers' copies are overwritten by the server's.

A worker that raises tells the server, which fails the waiting workers and raises itself; a
process that dies silently is detected after ``rpc_timeout_s`` without a message.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed.rpc as rpc
from torch import nn
from torch.utils.data import Dataset

from ..data.loaders import GlobalBatchLoader
from ..data.sampler import BatchPlan
from ..env.detect import detect_process
from ..env.process import seed_everything, select_device

__all__ = ["PSOptions", "PSResult", "ServerState", "run_parameter_server", "MODES", "SERVER",
           "get_server", "set_server", "call_server", "push_sync", "push_async", "abort"]

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


@dataclass
class PSResult:
    """What :func:`run_parameter_server` returns on each process."""

    role: str
    """server (rank 0) or worker."""
    rank: int
    mode: str
    losses: list[float] = field(default_factory=list)
    """Worker: its own loss per step. Server: per optimizer step, the workers' mean (sync), or each
    update's loss in the order applied (async)."""
    updates: int = 0
    """Server: optimizer steps applied (sync: steps; async: workers × steps). Worker: gradients sent."""
    staleness_mean: float = 0.0
    """Server: mean over updates of (server version at apply − version the gradient was computed on)."""
    staleness_max: int = 0
    state_dict: dict[str, torch.Tensor] | None = None
    """Server: the trained model's state (CPU tensors). Workers: None."""
    seconds: float = 0.0
    """Wall time from the RPC rendezvous to the last update."""


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
def _fetch() -> tuple[int, list[torch.Tensor]]:
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


def _finish(worker: int) -> None:
    s = _server()
    with s.lock:
        s.finished.add(worker)
        if len(s.finished) == s.workers:
            s.done.set()


def abort(worker: int, message: str) -> None:
    assert _SERVER is not None
    _SERVER.fail(f"parameter server: worker rank {worker} failed: {message}")


# --- the entry point -----------------------------------------------------------------------------
def run_parameter_server(
    model_fn: Callable[[], nn.Module],
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    dataset: Dataset,
    *,
    global_batch: int,
    steps: int,
    options: PSOptions | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
    seed: int = 0,
    accelerator: str = "auto",
    **option_fields: Any,
) -> PSResult:
    """Train ``model_fn()`` for ``steps`` global batches with rank 0 as parameter server.

    Call it on every process of the job (``paratrain.launch`` or ``paratrain run``): rank 0 serves,
    ranks 1..N-1 train. ``dataset`` yields ``(input, target)`` pairs; ``optimizer_fn`` receives the
    server's parameters. Options come as ``options=PSOptions(...)`` or as its fields
    (``mode="async"``, ``rpc_timeout_s=...``). ``accelerator`` picks the workers' device (the server
    stays on the CPU). Returns a :class:`PSResult` (the trained ``state_dict`` on rank 0).

    In sync mode each worker takes ``global_batch / workers`` samples per step; in async mode each
    worker takes the same slice but pushes on its own, so the server applies ``workers × steps``
    updates of ``global_batch / workers`` samples each.
    """
    if options is not None and option_fields:
        raise ValueError("pass either options=PSOptions(...) or its fields, not both")
    opts = options or PSOptions(**option_fields)
    info = detect_process()
    workers = info.world_size - 1
    if workers < 1:
        raise ValueError(f"a parameter server needs at least 2 processes (1 server + workers), but WORLD_SIZE="
                         f"{info.world_size}: launch with nprocs >= 2")
    if steps < 1:
        raise ValueError(f"steps {steps} must be at least 1")
    plan = BatchPlan.derive(global_batch, workers)  # one-line error when workers do not divide it
    n = len(dataset)  # type: ignore[arg-type]
    if n < global_batch:
        raise ValueError(f"the dataset has {n} samples, fewer than one global batch of {global_batch}")

    # env:// so the rendezvous also works under torchrun, whose agent already serves MASTER_PORT.
    os.environ.setdefault("MASTER_ADDR", info.master_addr)
    os.environ.setdefault("MASTER_PORT", str(info.master_port))
    backend_options = rpc.TensorPipeRpcBackendOptions(
        init_method="env://", rpc_timeout=opts.rpc_timeout_s,
        # shm/ibv need resources containers often lack; uv (TCP) works everywhere.
        _transports=["uv"],
    )
    global _SERVER
    is_server = info.rank == 0
    seed_everything(seed, offset_by_rank=not is_server)  # the server's init is the reference init
    model = model_fn()
    if is_server:
        _SERVER = ServerState(list(model.parameters()), optimizer_fn(model.parameters()), workers, opts.mode)
    name = SERVER if is_server else f"worker{info.rank}"
    with warnings.catch_warnings():
        # init_rpc builds a private gloo group for its barrier and warns about its own use of it.
        warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
        rpc.init_rpc(name, rank=info.rank, world_size=info.world_size, rpc_backend_options=backend_options)
    start = time.monotonic()
    try:
        if is_server:
            result = _serve(_SERVER, opts, info.rank)  # type: ignore[arg-type]
            result.state_dict = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        else:
            device = select_device(info.local_rank, accelerator)
            result = _work(model.to(device), dataset, plan, info.rank, device, steps, loss_fn, seed, opts)
        result.seconds = time.monotonic() - start
    except BaseException:
        with contextlib.suppress(Exception):  # keep the original error
            rpc.shutdown(graceful=False)  # local only: the others learn of the failure through their RPCs
        if is_server:
            _SERVER = None
        raise
    rpc.shutdown(graceful=True, timeout=opts.rpc_timeout_s)  # waits for every process to get here
    if is_server:
        _SERVER = None
    return result


def _serve(s: ServerState, opts: PSOptions, rank: int) -> PSResult:
    """Wait (the RPC threads do the work) until every worker finished, one failed, or all went silent."""
    while not s.done.wait(timeout=0.5):
        silent = time.monotonic() - s.last_message
        if silent > opts.rpc_timeout_s:
            # Workers that already pushed this sync step are waiting for the others, not silent.
            missing = sorted(set(range(1, s.workers + 1)) - s.finished - set(s.slots))
            s.fail(f"parameter server: no message from workers {missing} for {silent:.0f}s (rpc_timeout_s="
                   f"{opts.rpc_timeout_s}): a worker died or hangs")
    if s.error is not None:
        # The waiting workers' answers (this error) are sent by RPC threads: let them leave before
        # shutdown closes the pipes, or those workers only see "EOF" instead of the cause.
        time.sleep(1.0)
        raise RuntimeError(s.error)
    st = s.staleness
    return PSResult(role="server", rank=rank, mode=s.mode, losses=list(s.losses), updates=s.version,
                    staleness_mean=sum(st) / max(len(st), 1), staleness_max=max(st, default=0))


def _work(model: nn.Module, dataset: Dataset, plan: BatchPlan, rank: int, device: torch.device, steps: int,
          loss_fn: Callable[..., torch.Tensor], seed: int, opts: PSOptions) -> PSResult:
    """A worker's loop: pull parameters, gradient of this worker's slice of each global batch, push."""
    params = list(model.parameters())
    push = push_sync if opts.mode == "sync" else push_async
    done = 0
    loader = GlobalBatchLoader(dataset, plan, rank - 1, device, seed, position=lambda: done)
    result = PSResult(role="worker", rank=rank, mode=opts.mode)
    try:
        version, values = call_server(_fetch, (), rank, opts)
        while done < steps:
            for x, y in loader:  # one epoch from step `done` on; the next iter() is the next epoch
                with torch.no_grad():
                    for p, v in zip(params, values):
                        p.copy_(v)
                model.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                grads = [None if p.grad is None else p.grad.detach().cpu() for p in params]
                result.losses.append(loss.item())
                version, values = call_server(push, (rank, version, grads, result.losses[-1]), rank, opts)
                done += 1
                if done == steps:
                    break
        call_server(_finish, (rank,), rank, opts)
    except Exception as e:
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        with contextlib.suppress(Exception):  # the server may be the one that is gone
            rpc.rpc_sync(SERVER, abort, args=(rank, last), timeout=5)
        raise
    result.updates = done
    return result


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
