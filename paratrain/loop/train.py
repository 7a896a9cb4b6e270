"""The built-in job behind ``paratrain train``: config -> data, model, optimizer -> ``fit``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any

import torch
from torch import nn

from ..config import TrainConfig, to_toml
from ..data.augment import augment_for, eval_augment_for
from ..data.sampler import BatchPlan
from ..checkpoint.state import checkpoint_bytes
from ..env.disk import check_room, writing
from ..env.failures import explain_failure
from ..env.preemption import slurm_requeued
from ..env.provenance import provenance
from ..models.gpt import token_loss
from ..parallel import Parallel
from .fit import fit, planned_steps
from .logging import RunLogger, write_atomic
from .schedule import build_schedule

__all__ = ["run_training", "build_optimizer", "setup_task"]


def build_optimizer(params: Any, cfg: TrainConfig) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)


def setup_task(pt: Parallel, cfg: TrainConfig, total_steps: int) -> tuple[Any, Any, Any]:
    """The configured model and optimizer, set up by ``pt``, and the LR schedule over
    ``total_steps`` optimizer steps (``None`` for a constant, unscaled lr)."""
    model = cfg.build_model()
    model, optimizer = pt.setup(model, build_optimizer(model.parameters(), cfg))
    o = cfg.optim
    scheduler = build_schedule(optimizer.optimizer, schedule=o.schedule, total_steps=total_steps, warmup_steps=o.warmup_steps,
                               global_batch=pt.global_batch, base_batch=o.base_batch, step_size=max(1, o.step_size),
                               gamma=o.gamma, min_lr_ratio=o.min_lr_ratio)
    return model, optimizer, scheduler


def run_training(cfg: TrainConfig, plan: BatchPlan | None = None) -> dict[str, Any]:
    """Train the configured built-in task on this process's share of the job; returns the summary.
    ``plan``: the batch plan the caller already made for this process's world (else derived here)."""
    pt = Parallel(cfg.parallel, log_to=cfg.log_to if cfg.log_dir else None, log_dir=cfg.log_dir, plan=plan)
    try:
        d = cfg.data
        train_set, test_set = cfg.dataset(train=True), cfg.dataset(train=False)
        total = planned_steps(pt, train_set, cfg.epochs, cfg.max_steps)
        model, optimizer, scheduler = setup_task(pt, cfg, total)
        requeued = slurm_requeued()  # a Slurm job requeued after a preemption continues by itself
        restarted = cfg.checkpoint_dir is not None and (_restarts() > 0 or requeued
                                                         or _same_elastic_job(pt, cfg.checkpoint_dir))
        extra = pt.resume(cfg.checkpoint_dir, model, optimizer, scheduler, asked=cfg.resume and not requeued,
                          restarted=restarted,
                          refuse=lambda saved: _other_run(cfg, saved))  # the one call: checkpoint.resume
        resumed = None if extra is None else pt.global_step
        if resumed is not None and resumed >= total:
            kept = _finished_result(cfg.log_dir, resumed) if pt.is_main_process else None
            if _rank0_says(pt, kept is not None):  # nothing to train and the result is there: leave every file as it is
                pt.print(f"paratrain: this run already finished at step {resumed}; "
                         f"{os.path.join(cfg.log_dir, 'result.json')} is kept as it is "  # type: ignore[arg-type]
                         "(raise --epochs or --max-steps to train on)")
                pt.close()
                return kept or {}
        if resumed is not None:
            pt.print(f"paratrain: resumed from step {resumed} in {cfg.checkpoint_dir}"
                     + (f" (restart {_restarts()})" if _restarts() else ""))
        if cfg.checkpoint_dir is not None and pt.is_main_process:  # before the first save: room for two?
            check_room(cfg.checkpoint_dir, checkpoint_bytes(pt.unwrap(model), optimizer), "checkpoints",
                       flag="--checkpoint-dir")
        # Only the main process writes result.json and tracker runs: the others skip provenance's git calls.
        made_by = provenance(pt.describe()) if pt.is_main_process else None
        pt.trackers.config = {**dataclasses.asdict(cfg), "provenance": made_by}  # the trackers' run config
        logger = RunLogger(cfg.log_dir, enabled=pt.is_main_process, append=resumed is not None, trackers=pt.trackers)
        logger.write_text("config.toml", to_toml(cfg.as_new_run()))  # `paratrain train --config <run>/config.toml` re-runs it
        where = pt.describe()
        pt.print(f"paratrain: {where['strategy']} on {pt.world_size} process(es) (mesh {where['mesh']}), {pt.device}, "
                 f"precision {cfg.parallel.precision}; global batch {pt.plan}")
        loader_kwargs = {"num_workers": d.num_workers, "pin_memory": d.pin_memory,
                         "persistent_workers": d.persistent_workers}
        start = time.perf_counter()
        result = fit(pt, model, optimizer, train_set, epochs=cfg.epochs, max_steps=cfg.max_steps, loss_fn=loss_for(d.dataset),
                     eval_set=test_set, scheduler=scheduler, augment=augment_for(d.dataset) if d.augment else None,
                     eval_transform=_eval_transform(d.dataset), logger=logger, log_every=cfg.log_every,
                     progress_bar=cfg.progress, loader_kwargs=loader_kwargs, checkpoint_dir=cfg.checkpoint_dir,
                     checkpoint_every=cfg.checkpoint_every, checkpoint_extra={"config": dataclasses.asdict(cfg)},
                     keep_checkpoints=cfg.keep_checkpoints, checkpoint_async=cfg.checkpoint_async,
                     max_nonfinite_steps=cfg.max_nonfinite_steps,
                     stop_dir=os.path.join(cfg.log_dir, "checkpoints") if cfg.log_dir else None)  # what --resume reads
        if result.preempted:  # stopped by a signal at a step boundary, its checkpoint saved: no result yet
            logger.close()
            pt.close()
            return {"preempted": True, "steps": result.steps}
        train_loss = result.train_loss
        if result.steps == resumed:  # restarted after the last checkpoint: its logged loss is the run's
            logged = (extra or {}).get("train_loss")
            train_loss = float(logged) if isinstance(logged, (int, float)) else math.nan
        summary = {
            "config": dataclasses.asdict(cfg),
            "world_size": pt.world_size,
            "mesh": where["mesh"],  # the layout, "dp_replicate=2,dp_shard=2" ("1": one process)
            "resumed_from_step": resumed,
            "steps": result.steps,
            "train_loss": train_loss if math.isfinite(train_loss) else None,
            "test_loss": result.eval.get("loss"),
            "test_accuracy": result.eval.get("accuracy"),
            "test_count": result.eval.get("count"),
            "skipped_steps": result.skipped_steps,
            "seconds": time.perf_counter() - start,
            **result.throughput,
            **pt.report(),
            "provenance": made_by,
        }
        logger.write_json("result.json", summary)
        logger.close()
        tested = (f"test loss {summary['test_loss'] or math.nan:.4f}" if summary["test_accuracy"] is None
                  else f"test accuracy {100 * summary['test_accuracy']:.2f}%")  # a language model: its loss
        pt.print(f"finished {result.steps} steps in {summary['seconds']:.1f}s: train loss {train_loss:.4f}, "
                 f"{tested} on {summary['test_count']} samples"
                 + (f", {result.skipped_steps} fp16 overflow steps skipped" if result.skipped_steps else ""))
    except BaseException as e:
        why = explain_failure(e, pt.global_step + 1)  # who did not arrive, or the peer that ended first
        pt.close(wait_for_peers=False)  # peers may be gone: no barrier
        if why is not None:
            raise why from e
        raise
    pt.close()
    return summary


def _rank0_says(pt: Parallel, flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a collective): what only rank 0 read decides for all."""
    return pt.any_rank(flag and pt.is_main_process)


def _finished_result(log_dir: str | None, step: int) -> dict[str, Any] | None:
    """The complete result.json of a run that ended at ``step``, or None (missing, damaged, another step)."""
    if log_dir is None:
        return None
    try:
        with open(os.path.join(log_dir, "result.json")) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    complete = isinstance(result, dict) and result.get("steps") == step and result.get("test_count") is not None
    return result if complete else None


def _other_run(cfg: TrainConfig, extra: dict[str, Any] | None) -> str | None:
    """Why the checkpoint whose ``extra`` this is belongs to another kind of run, or None."""
    saved = (extra or {}).get("config")
    if not isinstance(saved, dict):
        return None
    for flag, now, was in (("--model", cfg.model, saved.get("model")),
                           ("--optimizer", cfg.optim.name, (saved.get("optim") or {}).get("name")),
                           ("--dataset", cfg.data.dataset, (saved.get("data") or {}).get("dataset"))):
        if was is not None and was != now:
            return (f"--resume: the checkpoints in {cfg.checkpoint_dir!r} were written with {flag} {was}, this run "
                    f"has {flag} {now}: resume with {flag} {was}, or train into another --checkpoint-dir")
    return None


JOB_MARKER = "rdzv-id"  # in the checkpoint folder: the elastic job (torchrun's rendezvous id) that writes there


def _same_elastic_job(pt: Parallel, checkpoint_dir: str) -> bool:
    """Whether this elastic job already trained into ``checkpoint_dir``: torchrun's agent restarts
    its workers when a node joins (scale-up) without counting a restart, so the job's rendezvous id,
    which rank 0 keeps in the folder, is what tells a restart from a new job. A collective under an
    elastic agent (same answer on every rank); ``False`` where there is no rendezvous id (torchrun's
    default ``none``) or it is a single-node job's private one."""
    from ..launch.torchrun import PRIVATE_RDZV_ID

    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if job in ("", "none") or job.startswith(PRIVATE_RDZV_ID):  # no job identity, or one invocation's own
        return False
    marker = os.path.join(checkpoint_dir, JOB_MARKER)
    same = False
    if pt.is_main_process:
        try:
            with open(marker) as f:
                same = f.read().strip() == job
        except OSError:
            same = False
        if not same:
            with writing(checkpoint_dir, flag="--checkpoint-dir"):
                os.makedirs(checkpoint_dir, exist_ok=True)
            write_atomic(marker, job + "\n")
    return _rank0_says(pt, same)


def _restarts() -> int:
    """How often torchrun has restarted this worker group (0: first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def loss_for(dataset: str) -> Any:
    """The training loss for a dataset name: next-token cross-entropy for token windows, else
    cross-entropy over classes."""
    return token_loss if dataset.startswith("tokens:") else nn.functional.cross_entropy


def _eval_transform(dataset: str) -> Any:
    aug = eval_augment_for(dataset)
    return None if aug is None else (lambda x: aug(x, 0))
