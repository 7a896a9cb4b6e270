"""The built-in job behind ``paratrain train``: config -> data, model, optimizer -> ``fit``."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Any

import torch

from ..config import TrainConfig
from ..data.augment import augment_for, eval_augment_for
from ..data.datasets import build_dataset, dataset_info
from ..data.loaders import EvalLoader
from ..models import build_model
from ..parallel import Parallel
from .fit import fit
from .logging import RunLogger
from .schedule import warmup_linear_scaling

__all__ = ["run_training", "build_optimizer"]


def build_optimizer(params: Any, cfg: TrainConfig) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)


def run_training(cfg: TrainConfig) -> dict[str, Any]:
    """Train the configured built-in task on this process's share of the job; returns the summary."""
    if cfg.parallel.strategy == "ps":
        return run_parameter_server_task(cfg)
    pt = Parallel(cfg.parallel)
    try:
        d = cfg.data
        train_set = build_dataset(d.dataset, True, d.data_dir, d.synthetic_size, cfg.parallel.seed)
        test_set = build_dataset(d.dataset, False, d.data_dir, d.synthetic_size, cfg.parallel.seed)
        info = dataset_info(d.dataset)
        model = build_model(cfg.model, tuple(info["input_shape"]), info["num_classes"])
        optimizer = build_optimizer(model.parameters(), cfg)
        model, optimizer = pt.setup(model, optimizer)
        scheduler = None
        if cfg.optim.warmup_steps or cfg.optim.base_batch:
            scheduler = warmup_linear_scaling(optimizer.optimizer, pt.plan.global_batch, cfg.optim.base_batch,
                                              cfg.optim.warmup_steps)
        resumed = _maybe_resume(pt, cfg, model, optimizer, scheduler)
        logger = RunLogger(cfg.log_dir, enabled=pt.is_main_process, append=resumed)
        pt.print(f"paratrain: {cfg.parallel.strategy} on {pt.world_size} process(es), {pt.device}, "
                 f"precision {cfg.parallel.precision}; global batch {pt.plan.global_batch} = "
                 f"{pt.plan.micro_batch} per worker x {pt.plan.world_size} data-parallel workers x {pt.accumulation} accumulation")
        loader_kwargs = {"num_workers": d.num_workers, "pin_memory": d.pin_memory,
                         "persistent_workers": d.persistent_workers}
        start = time.perf_counter()
        result = fit(pt, model, optimizer, train_set, epochs=cfg.epochs, max_steps=cfg.max_steps,
                     eval_set=test_set, scheduler=scheduler, augment=augment_for(d.dataset) if d.augment else None,
                     eval_transform=_eval_transform(d.dataset), logger=logger, log_every=cfg.log_every,
                     progress_bar=cfg.progress, loader_kwargs=loader_kwargs, checkpoint_dir=cfg.checkpoint_dir,
                     checkpoint_every=cfg.checkpoint_every, checkpoint_extra={"config": dataclasses.asdict(cfg)},
                     keep_checkpoints=cfg.keep_checkpoints, on_step=_fault_injection())
        summary = {
            "config": dataclasses.asdict(cfg),
            "world_size": pt.world_size,
            "resumed_from_step": resumed,
            "steps": result.steps,
            "train_loss": result.train_loss,
            "test_loss": result.eval.get("loss"),
            "test_accuracy": result.eval.get("accuracy"),
            "test_count": result.eval.get("count"),
            "skipped_steps": result.skipped_steps,
            "seconds": time.perf_counter() - start,
            **result.throughput,
        }
        logger.write_json("result.json", summary)
        pt.print(f"finished {result.steps} steps in {summary['seconds']:.1f}s: train loss {result.train_loss:.4f}, "
                 f"test accuracy {100 * (summary['test_accuracy'] or 0):.2f}% on {summary['test_count']} samples"
                 + (f", {result.skipped_steps} fp16 overflow steps skipped" if result.skipped_steps else ""))
    except BaseException:
        pt.close(wait_for_peers=False)  # peers may be gone: no barrier
        raise
    pt.close()
    return summary


def run_parameter_server_task(cfg: TrainConfig) -> dict[str, Any]:
    """``--strategy ps``: rank 0 serves the parameters, the other ranks train (seed 003)."""
    from ..strategies.ps import run_parameter_server

    d, p = cfg.data, cfg.parallel
    train_set = build_dataset(d.dataset, True, d.data_dir, d.synthetic_size, p.seed)
    info = dataset_info(d.dataset)
    make_model = lambda: build_model(cfg.model, tuple(info["input_shape"]), info["num_classes"])  # noqa: E731
    steps = cfg.max_steps or cfg.epochs * (len(train_set) // p.global_batch)  # type: ignore[arg-type]
    res = run_parameter_server(make_model, lambda params: build_optimizer(params, cfg), train_set,
                               global_batch=p.global_batch, steps=steps, options=p.ps, seed=p.seed,
                               accelerator=p.accelerator)
    if res.role != "server":
        return {"role": res.role, "rank": res.rank}
    model = make_model()
    model.load_state_dict(res.state_dict, strict=False)  # buffers stay on the workers
    test = _evaluate_alone(model.eval(), EvalLoader(build_dataset(d.dataset, False, d.data_dir, d.synthetic_size,
                                                                  p.seed), 256, 1, 0, torch.device("cpu"),
                                                    _eval_transform(d.dataset)))
    summary = {"config": dataclasses.asdict(cfg), "world_size": int(os.environ.get("WORLD_SIZE", "1")),
               "steps": steps, "updates": res.updates, "staleness_mean": res.staleness_mean,
               "staleness_max": res.staleness_max, "test_loss": test["loss"], "test_accuracy": test["accuracy"],
               "test_count": test["count"], "seconds": res.seconds}
    RunLogger(cfg.log_dir).write_json("result.json", summary)
    print(f"paratrain: parameter server ({p.ps.mode}) applied {res.updates} updates in {res.seconds:.1f}s"
          + (f", staleness mean {res.staleness_mean:.2f} max {res.staleness_max}" if p.ps.mode == "async" else "")
          + f"; test accuracy {100 * test['accuracy']:.2f}% on {test['count']} samples")
    return summary


@torch.no_grad()
def _evaluate_alone(model: torch.nn.Module, loader: EvalLoader) -> dict[str, float]:
    """Evaluation in one process, no collective (the ps workers have left by then)."""
    loss = correct = count = 0.0
    for x, y in loader:
        out = model(x)
        loss += float(torch.nn.functional.cross_entropy(out, y, reduction="sum"))
        correct += float((out.argmax(1) == y).sum())
        count += len(y)
    return {"loss": loss / max(count, 1), "accuracy": correct / max(count, 1), "count": int(count)}


def _maybe_resume(pt: Parallel, cfg: TrainConfig, model: Any, optimizer: Any, scheduler: Any) -> int | None:
    """Load the newest checkpoint when asked to, or automatically after torchrun restarted us."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not (cfg.resume or restarted) or cfg.checkpoint_dir is None:
        return None
    # A restart before the first checkpoint finds no directory yet: start from step 0.
    if not os.path.isdir(cfg.checkpoint_dir) or pt.load_checkpoint(cfg.checkpoint_dir, model, optimizer,
                                                                    scheduler) is None:
        pt.print(f"paratrain: no checkpoint in {cfg.checkpoint_dir} yet, starting from step 0")
        return None
    pt.print(f"paratrain: resumed from step {pt.global_step} in {cfg.checkpoint_dir}"
             + (f" (restart {os.environ['TORCHELASTIC_RESTART_COUNT']})" if restarted else ""))
    return pt.global_step


def _fault_injection() -> Any:
    """Test hook: ``PARATRAIN_TEST_KILL_AT=rank:step`` SIGKILLs that rank at that step, first attempt only."""
    spec = os.environ.get("PARATRAIN_TEST_KILL_AT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    rank, step = (int(v) for v in spec.split(":"))

    def maybe_die(pt: Parallel) -> None:
        if pt.rank == rank and pt.global_step == step:
            os.kill(os.getpid(), signal.SIGKILL)

    return maybe_die


def _eval_transform(dataset: str) -> Any:
    aug = eval_augment_for(dataset)
    return None if aug is None else (lambda x: aug(x, 0))
