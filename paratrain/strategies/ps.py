"""``ps``: a parameter server over ``torch.distributed.rpc`` (seed 003), synchronous or asynchronous SGD.

Two layouts share the server below. With :func:`run_parameter_server` (seed 003's), rank 0 is a
dedicated server: it holds the model's parameters and runs the optimizer. Ranks 1..N-1 are
workers: each pulls the parameters, computes a gradient on its shard of the data and pushes it
back. Every process calls the same function; the launcher is ``paratrain.launch`` or
``paratrain run`` (torchrun), as for the other strategies::

    def main(local_rank):
        return run_parameter_server(
            lambda: MLP(), lambda params: torch.optim.SGD(params, lr=0.05), trainset,
            global_batch=64, steps=200, mode="sync")

    server, *workers = paratrain.launch(main, nprocs=3)      # 1 server + 2 workers
    model.load_state_dict(server.state_dict)

Through ``Parallel`` (``strategy="ps"``, ``fit``, ``paratrain train --strategy ps``) the server is
*colocated*: rank 0 holds the parameters and the optimizer in its RPC threads and its main thread
trains like every other rank, so all N processes are workers and the global batch is split over
N exactly as for ddp. The user's loop is unchanged: ``optimizer.step()`` pushes this rank's
gradient to the server and loads the parameters it answers with (:class:`ParameterServer`).
``run_parameter_server`` above is seed 003's layout, a *dedicated* server process that trains
nothing, with its own built-in loop.

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
import copy
import math
import os
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn
from torch.utils.data import Dataset

from ..data.loaders import GlobalBatchLoader
from ..data.sampler import BatchPlan
from ..env.detect import detect_process
from ..env.process import Dist, seed_everything, select_device
from .base import Strategy

__all__ = ["PSOptions", "PSResult", "ParameterServer", "run_parameter_server", "MODES"]

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


class _Server:
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
                got = [g[i] for g in grads if g[i] is not None]
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


_SERVER: _Server | None = None


def _server() -> _Server:
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
def _push_sync(worker: int, version: int, grads: list[torch.Tensor | None], loss: float,
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


def _push_async(worker: int, version: int, grads: list[torch.Tensor | None], loss: float,
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


def _abort(worker: int, message: str) -> None:
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
        _SERVER = _Server(list(model.parameters()), optimizer_fn(model.parameters()), workers, opts.mode)
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


def _serve(s: _Server, opts: PSOptions, rank: int) -> PSResult:
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
    push = _push_sync if opts.mode == "sync" else _push_async
    done = 0
    loader = GlobalBatchLoader(dataset, plan, rank - 1, device, seed, position=lambda: done)
    result = PSResult(role="worker", rank=rank, mode=opts.mode)
    try:
        version, values = _call(_fetch, (), rank, opts)
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
                version, values = _call(push, (rank, version, grads, result.losses[-1]), rank, opts)
                done += 1
                if done == steps:
                    break
        _call(_finish, (rank,), rank, opts)
    except Exception as e:
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        with contextlib.suppress(Exception):  # the server may be the one that is gone
            rpc.rpc_sync(SERVER, _abort, args=(rank, last), timeout=5)
        raise
    result.updates = done
    return result


def _call(fn: Callable[..., Any], args: tuple, rank: int, opts: PSOptions) -> Any:
    """``rpc_sync`` to the server, with one-line errors instead of RPC's multi-line remote tracebacks."""
    try:
        out = rpc.rpc_sync(SERVER, fn, args=args)
    except Exception as e:  # a remote error keeps its type, with the server's traceback in the text
        text = str(e)
    else:
        if isinstance(out, Exception):  # a sync step the server failed (see _Server.fail)
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


# --- the strategy behind Parallel: a colocated server ---------------------------------------------
def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The numeric settings of each param group (lr, momentum, betas...): what schedulers change."""
    def numeric(v: Any) -> bool:
        return isinstance(v, (int, float)) or (isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v))

    return [{k: v for k, v in g.items() if k != "params" and numeric(v)} for g in optimizer.param_groups]


def _server_optimizer(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                      index: dict[int, int]) -> torch.optim.Optimizer:
    """The same optimizer class and param groups as ``optimizer``, over the server's copies."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[index[id(p)]] for p in g["params"]]}
              for g in optimizer.param_groups]
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except Exception as e:
        raise ValueError(f"ps: cannot rebuild {type(optimizer).__name__} on the parameter server from its param "
                         f"groups and defaults ({type(e).__name__}: {e}): use a torch.optim optimizer") from None


class ParameterServer(Strategy):
    """``ps`` behind ``Parallel``: every rank trains; rank 0 also serves the parameters over RPC.

    ``setup`` starts RPC (its rendezvous address is chosen by rank 0 and sent over the process
    group) and gives rank 0 a CPU copy of the parameters with a server-side twin of the user's
    optimizer (same class, groups and defaults). Each ``optimizer.step()`` pushes this rank's
    gradient with its param groups' hyperparameters (so LR schedulers keep working) and copies
    the answered parameters into the model; the user's optimizer never steps and holds no state.
    sync == ddp's numerics (the mean of the ranks' gradients, one step per global batch); async
    applies each rank's gradient on arrival. Gradient clipping runs on the server, after the mean.
    Only parameters travel: buffers (BatchNorm statistics) stay on each rank.
    """

    name = "ps"

    def __init__(self, dist_info: Dist, sync_batchnorm: bool = False, options: PSOptions | None = None) -> None:
        super().__init__(dist_info, sync_batchnorm, options or PSOptions())
        self._params: list[nn.Parameter] = []
        self._version = 0
        self.bytes_per_step = 0
        """Payload this rank sends and receives per optimizer step (gradients + parameters)."""
        self._rpc = False

    # --- setup ----------------------------------------------------------------------------
    def _distributed(self) -> bool:
        return self.dist.backend is not None and self.dist.world_size > 1

    def _start_rpc(self) -> None:
        from ..launch.spawn import free_port

        host = self.dist.info.master_addr if self._distributed() else "127.0.0.1"
        where: list[Any] = [free_port(host) if self.dist.rank == 0 else None]
        if self._distributed():
            dist.broadcast_object_list(where, src=0)
        opts: PSOptions = self.options
        backend_options = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://{host}:{where[0]}", rpc_timeout=opts.rpc_timeout_s, _transports=["uv"])
        name = SERVER if self.dist.rank == 0 else f"worker{self.dist.rank}"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
            rpc.init_rpc(name, rank=self.dist.rank, world_size=self.dist.world_size, rpc_backend_options=backend_options)
        self._rpc = True

    def setup_model(self, model: nn.Module) -> nn.Module:
        if self._params:
            raise ValueError("ps: Parallel serves one model; build another Parallel for a second one")
        if self.sync_batchnorm:
            self.warn("sync_batchnorm has no effect with ps: only parameters travel, BatchNorm statistics stay on "
                      "each rank", rank=self.dist.rank)
        model = model.to(self.device)
        self._params = list(model.parameters())
        return model

    def setup_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Start RPC; on rank 0, create the server (parameter copies + the optimizer's twin)."""
        global _SERVER
        index = {id(p): i for i, p in enumerate(self._params)}
        stray = [i for g in optimizer.param_groups for i, p in enumerate(g["params"]) if id(p) not in index]
        if stray:
            raise ValueError("ps: the optimizer holds parameters that are not the model's: build it over "
                             "model.parameters()")
        if self.dist.rank == 0:
            if _SERVER is not None:
                raise RuntimeError("ps: this process already serves a model: close the other Parallel first")
            params = [p.detach().cpu().clone() for p in self._params]
            _SERVER = _Server(params, _server_optimizer(optimizer, params, index), self.dist.world_size,
                              self.options.mode, self.max_grad_norm)
        try:
            self._start_rpc()  # init_rpc is itself a rendezvous: the server exists before anyone pushes
        except BaseException:
            if self.dist.rank == 0:
                _SERVER = None
            raise
        self.bytes_per_step = 2 * sum(p.numel() * p.element_size() for p in self._params)
        return optimizer

    # --- the step -------------------------------------------------------------------------
    def optimizer_step(self, optimizer: torch.optim.Optimizer, local_step: Callable[[], bool]) -> bool:
        """Push this rank's gradient (and lr...) to the server, load the parameters it answers."""
        if not self._rpc:
            raise RuntimeError("ps: the optimizer was not set up: call pt.setup(model, optimizer)")
        opts: PSOptions = self.options
        grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in self._params]
        push = _push_sync if opts.mode == "sync" else _push_async
        self._version, values = _call(push, (self.dist.rank, self._version, grads, math.nan,
                                             _hyperparameters(optimizer)), self.dist.rank, opts)
        with torch.no_grad():
            for p, v in zip(self._params, values):
                p.copy_(v, non_blocking=True)
                p.grad = None
        # A no-op step (no parameter has a gradient): the optimizer's step hooks run, and LR
        # schedulers see that optimizer.step() was called before them.
        optimizer.step()
        return True

    def report(self) -> dict[str, Any]:
        """On rank 0: updates the server applied and their staleness (versions applied between a
        gradient's parameters and its own update). Elsewhere: empty."""
        if self.dist.rank != 0 or _SERVER is None:
            return {}
        with _SERVER.lock:
            st = list(_SERVER.staleness)
            return {"ps_mode": self.options.mode, "ps_updates": _SERVER.version,
                    "ps_staleness_mean": sum(st) / max(len(st), 1), "ps_staleness_max": max(st, default=0)}

    # --- checkpoints ----------------------------------------------------------------------
    def _server_state(self, module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
        s = _server()
        with s.lock:
            state = module.state_dict()
            for (name, _), v in zip(module.named_parameters(), s.params):
                state[name] = v.detach().clone()
            # A deep copy: in async mode other ranks keep stepping the live state while it is written.
            return state, copy.deepcopy(s.optimizer.state_dict())

    def checkpoint_state(self, module: nn.Module, optimizer: Any) -> tuple[dict, dict | None]:
        """The server's parameters and optimizer state (rank 0 writes checkpoints), with the
        param groups' hyperparameters of the local optimizer: a scheduler has already moved its
        lr past the one the server applied last."""
        if self.dist.rank != 0:
            return super().checkpoint_state(module, optimizer)
        model_state, optim_state = self._server_state(module)
        if optimizer is None:
            return model_state, None
        for group, values in zip(optim_state["param_groups"], _hyperparameters(optimizer)):
            group.update(values)
        return model_state, optim_state

    def load_checkpoint_state(self, module: nn.Module, optimizer: Any, model_state: dict, optim_state: dict) -> None:
        super().load_checkpoint_state(module, optimizer, model_state, optim_state)
        if self.dist.rank == 0:
            s = _server()
            with s.lock, torch.no_grad():
                for p, v in zip(s.params, module.parameters()):
                    p.copy_(v)
                if optimizer is not None and optim_state is not None:
                    s.optimizer.load_state_dict(optim_state)
        if optimizer is not None:
            optimizer.state.clear()  # the server's twin holds the state; the local one never steps
        if self._distributed():
            dist.barrier()  # nobody pushes before the server holds the checkpoint

    def sync_from_model(self, module: nn.Module) -> None:
        """After the user loads weights into the set-up model (``model.load_state_dict``): rank 0
        copies them into the server, so the next step does not bring the old values back."""
        if self.dist.rank == 0 and _SERVER is not None:
            with _SERVER.lock, torch.no_grad():
                for p, v in zip(_SERVER.params, module.parameters()):
                    p.copy_(v)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The server's trained parameters (and rank 0's buffers) on every rank. Collective."""
        box: list[Any] = [None]
        if self.dist.rank == 0:
            box[0] = {k: v.detach().cpu().clone() for k, v in self._server_state(model)[0].items()}
        if self._distributed():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    # --- teardown -------------------------------------------------------------------------
    def close(self, wait_for_peers: bool = True) -> None:
        """Leave RPC: gracefully (waits for every rank), or after an error telling the server why."""
        global _SERVER
        if not self._rpc:
            return
        self._rpc = False
        if wait_for_peers:
            rpc.shutdown(graceful=True, timeout=self.options.rpc_timeout_s)
        else:
            if self.dist.rank != 0:
                with contextlib.suppress(Exception):
                    rpc.rpc_sync(SERVER, _abort, args=(self.dist.rank, "it stopped after an error"), timeout=5)
            elif _SERVER is not None:
                # Answer the ranks waiting on a sync step with the cause, not a broken pipe.
                _SERVER.fail("parameter server: rank 0 (which hosts the server) stopped after an error")
                time.sleep(1.0)
            with contextlib.suppress(Exception):
                rpc.shutdown(graceful=False)
        if self.dist.rank == 0:
            _SERVER = None
