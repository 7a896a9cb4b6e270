"""One process of one ``verify`` run: train K steps under the probe, return the final state.

Two kinds of job:

* a built-in job (a :class:`~paratrain.config.TrainConfig`, as ``paratrain train`` runs it), trained
  with ``Parallel`` + ``fit`` for ``steps`` optimizer steps;
* a user's function (``--entry module:function`` or ``path/to/script.py:function``), called as
  ``function(steps)`` in every process with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
  set as torchrun sets them. It trains ``steps`` optimizer steps and returns the trained model,
  its ``state_dict()``, or ``(model_or_state_dict, losses)`` with one loss per optimizer step.
"""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import io
import math
import os
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..nn.syncbn import has_unsynced_batchnorm
from ..env.process import destroy, preload_dynamo
from ..userfn import load_callable
from .probe import Probe, clean_name

__all__ = ["run_job", "load_entry", "unsynced_batchnorm_layers"]


def load_entry(spec: str) -> Callable[..., Any]:
    """The function named by ``module:function`` or ``path/to/file.py:function``."""
    fn = load_callable(spec, "--entry")
    name = spec.rpartition(":")[2]
    if len(inspect.signature(fn).parameters) < 1:
        raise ValueError(f"--entry {spec!r}: {name}() must take the number of optimizer steps, e.g. def {name}(steps)")
    return fn


def unsynced_batchnorm_layers(model: nn.Module | None) -> list[str]:
    """Names of BatchNorm layers that compute their statistics per process."""
    if model is None or not has_unsynced_batchnorm(model):
        return []
    from torch.nn.modules.batchnorm import _BatchNorm

    from ..nn.syncbn import SyncBatchNorm

    return [clean_name(n) for n, m in model.named_modules()
            if isinstance(m, _BatchNorm) and not isinstance(m, (nn.SyncBatchNorm, SyncBatchNorm))]


def _cpu_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[clean_name(k)] = v.detach().to("cpu").clone()
    return out


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside paratrain's ParallelModule, DDP or DataParallel wrappers."""
    while True:
        original = model.__dict__.get("original")  # ParallelModule keeps it outside _modules
        if isinstance(original, nn.Module):
            model = original
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def run_job(local_rank: int, job: dict[str, Any]) -> dict[str, Any]:
    """Run ``job`` in this process under the probe; return state, losses and observations."""
    torch.set_num_threads(job.get("threads", 1))
    faulthandler.dump_traceback_later(max(1.0, job["timeout"] - 5))  # a hang shows where, before the kill
    probe = Probe().install()
    state: dict[str, torch.Tensor] = {}
    losses: list[float] | None = None
    model: nn.Module | None = None
    error = None
    built: list[dict[str, Any]] = []
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the report is the output, not N processes' prints
            with _recording_parallel(built):  # both kinds: RunView.merge reads it to count each shard once
                if job["kind"] == "entry":
                    state, losses, model = _run_entry(job)
                else:
                    state, losses, model = _run_builtin(job, probe)
    except Exception as e:  # noqa: BLE001 - what the probe saw before the failure still names its cause
        error = f"{type(e).__name__}: {next((ln for ln in str(e).splitlines() if ln.strip()), '')}".strip()
    finally:
        probe.remove()
        faulthandler.cancel_dump_traceback_later()
    model = model if model is not None else (_unwrap(probe.root) if probe.root is not None else None)
    return {"rank": int(os.environ.get("RANK", local_rank)), "world_size": int(os.environ.get("WORLD_SIZE", 1)),
            "state": state, "losses": losses, "probe": probe.summary(), "error": error, "parallel": built,
            "unsynced_bn": unsynced_batchnorm_layers(model), "dropout": dropout_layers(model)}


def dropout_layers(model: nn.Module | None) -> list[str]:
    """Names of dropout layers that drop something in training (p > 0)."""
    if model is None:
        return []
    from torch.nn.modules.dropout import _DropoutNd

    return [clean_name(n) for n, m in model.named_modules() if isinstance(m, _DropoutNd) and m.p > 0]


@contextlib.contextmanager
def _recording_parallel(built: list[dict[str, Any]]) -> Iterator[None]:
    """Append what each ``paratrain.Parallel`` made in this block runs to ``built``: the options
    verify hands a user's function as Parallel's defaults must show there, and whether this rank
    leads its data shard, from which :meth:`~paratrain.verify.diagnose.RunView.merge` counts a
    shard's samples once (for a built-in job and a user's function alike)."""
    from ..parallel import Parallel

    init = Parallel.__init__

    def recorded(self: Parallel, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append({"strategy": self.config.strategy, "precision": self.config.precision,
                      "accumulation": self.accumulation, "data_parallel_leader": self.data_parallel_leader})

    Parallel.__init__ = recorded  # type: ignore[method-assign]
    try:
        yield
    finally:
        Parallel.__init__ = init  # type: ignore[method-assign]


def _run_entry(job: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[float] | None, nn.Module | None]:
    # A user's script calls init_process_group itself; DDP's torch._dynamo import must come first
    # (see paratrain.env.process.init: otherwise gloo can abort the exiting worker, torch 2.13).
    preload_dynamo()

    fn = load_entry(job["entry"])
    try:
        out = fn(job["steps"])
        losses = None
        if isinstance(out, tuple) and len(out) == 2:
            out, losses = out
            losses = [float(v) for v in losses]
        # the state before the group goes: a sharded (FSDP2, DTensor) tensor's full_tensor() is a collective
        if isinstance(out, nn.Module):
            model: nn.Module | None = _unwrap(out)
            state = _cpu_state(model.state_dict())  # type: ignore[union-attr]
        elif isinstance(out, dict):
            model, state = None, _cpu_state(out)
        else:
            raise TypeError(f"{job['entry']} returned {type(out).__name__}: return the trained model, its state_dict(), "
                            "or (model, losses)")
    except BaseException:
        destroy(wait_for_peers=False)  # peers may be gone: no barrier
        raise
    destroy(wait_for_peers=True)  # a barrier first: see paratrain.env.process.destroy
    return state, losses, model


class _LossLog:
    """A RunLogger stand-in that keeps fit's per-step loss records in memory."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def log(self, record: dict[str, Any], kind: str = "train") -> None:
        if kind == "train":
            self.losses.append(float(record["loss"]))

    def write_json(self, name: str, obj: Any) -> None:
        pass


def _run_builtin(job: dict[str, Any], probe: Probe) -> tuple[dict[str, torch.Tensor], list[float], nn.Module]:
    from ..config import TrainConfig
    from ..data.augment import augment_for
    from ..loop.fit import fit
    from ..loop.train import setup_task
    from ..parallel import Parallel

    cfg: TrainConfig = job["config"]
    pt = Parallel(cfg.parallel)
    try:
        d = cfg.data
        train_set = job.get("data")
        if train_set is None:
            train_set = cfg.dataset(train=True)
        model, optimizer, scheduler = setup_task(pt, cfg, job["steps"])
        # Count the micro-batches paratrain hands to the strategy, on every rank: a pipeline's
        # stages run forwards on micro-batches and activations, not on the inputs. The ranks of a
        # tensor-parallel group or of a pipeline read the same batch: RunView.merge keeps one rank
        # per data shard, from the Parallel _recording_parallel saw.
        probe.count_forwards = False
        step = pt.training_step

        def counted_step(model: Any, batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            probe.record_batch(batch[0])
            return step(model, batch, *args, **kwargs)

        pt.training_step = counted_step  # type: ignore[method-assign]
        steps = job["steps"]
        epochs = math.ceil(steps / pt.steps_per_epoch(train_set))
        log = _LossLog()
        fit(pt, model, optimizer, train_set, epochs=epochs, max_steps=steps, scheduler=scheduler,
            augment=augment_for(d.dataset) if d.augment else None, logger=log, log_every=1,  # type: ignore[arg-type]
            progress_bar=False)
        result = _cpu_state(pt.full_state_dict(model)), log.losses, pt.unwrap(model)
    except BaseException:
        pt.close(wait_for_peers=False)  # peers may be gone: no barrier
        raise
    pt.close()
    return result
