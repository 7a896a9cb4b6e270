"""``ps``: a parameter server as a strategy behind ``Parallel``, sync or async SGD.

Through ``Parallel`` (``strategy="ps"``, ``fit``, ``paratrain train --strategy ps``) the server is
*colocated*: rank 0 holds the parameters and the optimizer in its RPC threads and its main thread
trains like every other rank, so all N processes are workers and the global batch is split over
N exactly as for ddp. The user's loop is unchanged: ``optimizer.step()`` pushes this rank's
gradient to the server and loads the parameters it answers with (:class:`ParameterServerStrategy`).

The server itself and the sync/async modes are in :mod:`paratrain.ps.server`; the
*dedicated* layout (:func:`run_parameter_server`: rank 0 serves and trains nothing) is in
:mod:`paratrain.ps.dedicated`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn

from ..env.network import free_port, store_init_method
from ..env.process import Dist
from ..precision.base import Stepped
from .base import Strategy
from ..ps.dedicated import PSResult, run_parameter_server
from ..ps.server import (MODES, SERVER, PSOptions, ServerState, abort, call_server, get_server, push_async, push_sync,
                         set_server)

__all__ = ["ParameterServerStrategy", "PSOptions", "PSResult", "run_parameter_server", "MODES"]


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
    # Every group carries all its hyperparameters; the defaults only matter for later groups. Some
    # defaults are not constructor arguments (torch 2.13's AdamW: decoupled_weight_decay): pass
    # only those the constructor takes.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    try:
        return type(optimizer)(groups, **defaults)
    except Exception as e:
        raise ValueError(f"ps: cannot rebuild {type(optimizer).__name__} on the parameter server from its param "
                         f"groups and defaults ({type(e).__name__}: {e}): use a torch.optim optimizer") from None


class ParameterServerStrategy(Strategy):
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
    local_overflow_skip = False
    options_class = PSOptions

    def __init__(self, dist_info: Dist, sync_batchnorm: bool = False, options: PSOptions | None = None, **common: Any) -> None:
        super().__init__(dist_info, sync_batchnorm, options or PSOptions(), **common)
        self._params: list[nn.Parameter] = []
        self._version = 0
        self.bytes_per_step = 0
        """Payload this rank sends and receives per optimizer step (gradients + parameters)."""
        self._rpc = False

    # --- setup ----------------------------------------------------------------------------
    def _distributed(self) -> bool:
        return self.proc.backend is not None and self.proc.world_size > 1

    def _start_rpc(self) -> None:
        host = self.proc.info.master_addr if self._distributed() else "127.0.0.1"
        where: list[Any] = [free_port(host) if self.proc.rank == 0 else None]
        if self._distributed():
            dist.broadcast_object_list(where, src=0)
        opts: PSOptions = self.options
        backend_options = rpc.TensorPipeRpcBackendOptions(
            init_method=store_init_method(host, where[0]), rpc_timeout=opts.rpc_timeout_s, _transports=["uv"])
        name = SERVER if self.proc.rank == 0 else f"worker{self.proc.rank}"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
            rpc.init_rpc(name, rank=self.proc.rank, world_size=self.proc.world_size, rpc_backend_options=backend_options)
        self._rpc = True

    def setup_model(self, model: nn.Module) -> nn.Module:
        if self._params:
            raise ValueError("ps: Parallel serves one model; build another Parallel for a second one")
        if self.sync_batchnorm:
            self.warn("sync_batchnorm has no effect with ps: only parameters travel, BatchNorm statistics stay on "
                      "each rank", rank=self.proc.rank)
        model = model.to(self.device)
        self._params = list(model.parameters())
        return model

    def setup_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Start RPC; on rank 0, create the server (parameter copies + the optimizer's twin)."""
        index = {id(p): i for i, p in enumerate(self._params)}
        stray = [i for g in optimizer.param_groups for i, p in enumerate(g["params"]) if id(p) not in index]
        if stray:
            raise ValueError("ps: the optimizer holds parameters that are not the model's: build it over "
                             "model.parameters()")
        if self.proc.rank == 0:
            if get_server() is not None:
                raise RuntimeError("ps: this process already serves a model: close the other Parallel first")
            params = [p.detach().cpu().clone() for p in self._params]
            set_server(ServerState(params, _server_optimizer(optimizer, params, index), self.proc.world_size,
                                   self.options.mode, self.max_grad_norm))
        try:
            self._start_rpc()  # init_rpc is itself a rendezvous: the server exists before anyone pushes
        except BaseException:
            if self.proc.rank == 0:
                set_server(None)
            raise
        self.bytes_per_step = 2 * sum(p.numel() * p.element_size() for p in self._params)
        return optimizer

    # --- the step -------------------------------------------------------------------------
    def hidden_comm_bytes_per_step(self, model: nn.Module) -> int:
        return self.bytes_per_step  # RPC push + pull inside optimizer.step

    def optimizer_step(self, optimizer: torch.optim.Optimizer, local_step: Callable[[], bool | Stepped]) -> bool:
        """Push this rank's gradient (and lr...) to the server, load the parameters it answers."""
        if not self._rpc:
            raise RuntimeError("ps: the optimizer was not set up: call pt.setup(model, optimizer)")
        opts: PSOptions = self.options
        grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in self._params]
        push = push_sync if opts.mode == "sync" else push_async
        self._version, values = call_server(push, (self.proc.rank, self._version, grads, math.nan,
                                             _hyperparameters(optimizer)), self.proc.rank, opts)
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
        s = self._hosted()
        if s is None:
            return {}
        with s.lock:
            st = list(s.staleness)
            return {"ps_mode": self.options.mode, "ps_updates": s.version,
                    "ps_staleness_mean": sum(st) / max(len(st), 1), "ps_staleness_max": max(st, default=0)}

    def _hosted(self) -> ServerState | None:
        """The server this process hosts (rank 0 after setup), else None."""
        return get_server() if self.proc.rank == 0 else None

    def _copy_into_server(self, module: nn.Module) -> None:
        s = self._hosted()
        if s is not None:
            with s.lock, torch.no_grad():
                for p, v in zip(s.params, module.parameters()):
                    p.copy_(v)

    # --- checkpoints ----------------------------------------------------------------------
    def _server_state(self, module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
        s = self._hosted()
        assert s is not None, "ps: only rank 0, after setup, holds the server's state"
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
        if self.proc.rank != 0:
            return super().checkpoint_state(module, optimizer)
        model_state, optim_state = self._server_state(module)
        if optimizer is None:
            return model_state, None
        for group, values in zip(optim_state["param_groups"], _hyperparameters(optimizer)):
            group.update(values)
        return model_state, optim_state

    def load_checkpoint_state(self, module: nn.Module, optimizer: Any, model_state: dict[str, Any],
                              optim_state: dict[str, Any] | None) -> None:
        super().load_checkpoint_state(module, optimizer, model_state, optim_state)
        self._copy_into_server(module)
        s = self._hosted()
        if s is not None and optimizer is not None and optim_state is not None:
            with s.lock:
                s.optimizer.load_state_dict(optim_state)
        if optimizer is not None:
            optimizer.state.clear()  # the server's twin holds the state; the local one never steps
        if self._distributed():
            dist.barrier()  # nobody pushes before the server holds the checkpoint

    def sync_from_model(self, module: nn.Module) -> None:
        """After the user loads weights into the set-up model (``model.load_state_dict``): rank 0
        copies them into the server, so the next step does not bring the old values back."""
        self._copy_into_server(module)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The server's trained parameters (and rank 0's buffers) on every rank. Collective."""
        box: list[Any] = [None]
        if self.proc.rank == 0:
            box[0] = {k: v.detach().cpu().clone() for k, v in self._server_state(model)[0].items()}
        if self._distributed():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    # --- teardown -------------------------------------------------------------------------
    def close(self, wait_for_peers: bool = True) -> None:
        """Leave RPC: gracefully (waits for every rank), or after an error telling the server why."""
        if not self._rpc:
            return
        self._rpc = False
        if wait_for_peers:
            rpc.shutdown(graceful=True, timeout=self.options.rpc_timeout_s)
        else:
            if self.proc.rank != 0:
                with contextlib.suppress(Exception):
                    rpc.rpc_sync(SERVER, abort, args=(self.proc.rank, "it stopped after an error"), timeout=5)
            elif (hosted := self._hosted()) is not None:
                # Answer the ranks waiting on a sync step with the cause, not a broken pipe.
                hosted.fail("parameter server: rank 0 (which hosts the server) stopped after an error")
                time.sleep(1.0)
            with contextlib.suppress(Exception):
                rpc.shutdown(graceful=False)
        if self.proc.rank == 0:
            set_server(None)
