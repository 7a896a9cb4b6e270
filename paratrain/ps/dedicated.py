"""The dedicated parameter-server layout (rank 0 only serves) over ``torch.distributed.rpc``.

:func:`run_parameter_server`: rank 0 is a dedicated server (:mod:`paratrain.ps.server`) that trains nothing, ranks
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
  parameters equal a one-process loop over the same global batches (``tests/ps/test_ps.py``).
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
from ..data.sampler import BatchPlan, check_dataset_fits
from ..env.detect import detect_process
from ..env.network import agent_serves_store, store_init_method
from ..env.devices import select_device
from ..env.seeding import seed_everything
from .server import SERVER, PSOptions, ServerState, abort, call_server, fetch, finish, push_async, push_sync, set_server

__all__ = ["PSResult", "run_parameter_server"]


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
    check_dataset_fits(len(dataset), global_batch)  # type: ignore[arg-type]

    # env:// where torchrun's agent already serves MASTER_PORT; on one node a store that listens on
    # loopback only (env:// would listen on every interface).
    os.environ.setdefault("MASTER_ADDR", info.master_addr)
    os.environ.setdefault("MASTER_PORT", str(info.master_port))
    backend_options = rpc.TensorPipeRpcBackendOptions(
        init_method="env://" if agent_serves_store() else store_init_method(os.environ["MASTER_ADDR"],
                                                                           int(os.environ["MASTER_PORT"])),
        rpc_timeout=opts.rpc_timeout_s,
        # shm/ibv need resources containers often lack; uv (TCP) works everywhere.
        _transports=["uv"],
    )
    is_server = info.rank == 0
    seed_everything(seed, offset_by_rank=not is_server)  # the server's init is the reference init
    model = model_fn()
    server = ServerState(list(model.parameters()), optimizer_fn(model.parameters()), workers, opts.mode) \
        if is_server else None
    set_server(server)
    name = SERVER if is_server else f"worker{info.rank}"
    with warnings.catch_warnings():
        # init_rpc builds a private gloo group for its barrier and warns about its own use of it.
        warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
        rpc.init_rpc(name, rank=info.rank, world_size=info.world_size, rpc_backend_options=backend_options)
    start = time.monotonic()
    try:
        if is_server:
            assert server is not None
            result = _serve(server, opts, info.rank)
            result.state_dict = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        else:
            device = select_device(info.local_rank, accelerator)
            result = _work(model.to(device), dataset, plan, info.rank, device, steps, loss_fn, seed, opts)
        result.seconds = time.monotonic() - start
    except BaseException:
        with contextlib.suppress(Exception):  # keep the original error
            rpc.shutdown(graceful=False)  # local only: the others learn of the failure through their RPCs
        set_server(None)
        raise
    rpc.shutdown(graceful=True, timeout=opts.rpc_timeout_s)  # waits for every process to get here
    if info.rank == 0:  # the RPC store's host: the others may still read its last count (torch 2.13's join)
        time.sleep(1.0)
    set_server(None)
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
        version, values = call_server(fetch, (), rank, opts)
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
        call_server(finish, (rank,), rank, opts)
    except Exception as e:
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        with contextlib.suppress(Exception):  # the server may be the one that is gone
            rpc.rpc_sync(SERVER, abort, args=(rank, last), timeout=5)
        raise
    result.updates = done
    return result
