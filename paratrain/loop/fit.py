"""``fit``: the whole training loop, on one screen."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from ..checkpoint import wait_for_checkpoint
from ..data.stream import StreamLoader
from ..parallel import Parallel
from .guard import LossWindow
from .logging import RunLogger, Throughput, progress

__all__ = ["fit", "FitResult", "planned_steps"]


@dataclass
class FitResult:
    steps: int
    train_loss: float
    eval: dict[str, float] = field(default_factory=dict)
    throughput: dict[str, float] = field(default_factory=dict)
    """samples/s, step time and data-wait share over the whole call (evaluation excluded)."""
    skipped_steps: int = 0
    preempted: bool = False
    """A stop signal ended the run early (``pt.should_stop``), its checkpoint saved."""


def fit(
    pt: Parallel,
    model: nn.Module,
    optimizer: Any,
    train_set: Dataset,
    *,
    epochs: int = 1,
    max_steps: int | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
    eval_set: Dataset | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    augment: Callable[..., torch.Tensor] | None = None,
    eval_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    logger: RunLogger | None = None,
    log_every: int = 10,
    progress_bar: bool = True,
    loader_kwargs: dict[str, Any] | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    checkpoint_extra: dict[str, Any] | None = None,
    keep_checkpoints: int = 3,
    checkpoint_async: bool = False,
    on_step: Callable[[Parallel], None] | None = None,
    max_nonfinite_steps: int = 3,
    stop_dir: str | None = None,
) -> FitResult:
    """Train ``model`` (already ``pt.setup``) for ``epochs`` or ``max_steps`` optimizer steps.

    Continues from ``pt.global_step`` (so a resumed run picks up mid-epoch). A stream
    (``IterableDataset``, of unknown length) trains for ``max_steps``, which it needs, reading the
    stream again from its start as often as that takes; ``epochs`` does not apply. Evaluates after
    every epoch or pass over the stream (once, if there is nothing left to train); logs loss, lr and throughput every
    ``log_every`` steps on the main process; checkpoints to ``checkpoint_dir`` every
    ``checkpoint_every`` steps and at the end, with the last logged loss (``extra["train_loss"]``),
    in the background with ``checkpoint_async`` (the last one is complete when ``fit`` returns).
    A loss that is NaN/inf for ``max_nonfinite_steps`` steps in a row raises
    :class:`~paratrain.loop.guard.NonFiniteLossError`, and no checkpoint is written after a NaN.
    A stop signal (``pt.should_stop``: a preemption) ends it at the next step boundary, with a
    checkpoint in ``checkpoint_dir`` (else ``stop_dir``) and ``preempted`` set; nothing is evaluated.
    """
    loader = pt.train_loader(train_set, transform=augment, **(loader_kwargs or {}))
    evaluator = pt.eval_loader(eval_set, transform=eval_transform) if eval_set is not None else None
    logger = logger or RunLogger(None)
    total = _stream_steps(max_steps) if isinstance(loader, StreamLoader) else _total(loader.steps_per_epoch, epochs, max_steps)
    bar = progress(int(total - pt.global_step), pt.is_main_process and progress_bar, "train")
    meter, run, first_step = Throughput(), Throughput(), pt.global_step  # log window; whole call
    result = FitResult(first_step, math.nan)
    window = LossWindow(pt, log_every, max_nonfinite_steps, bool(checkpoint_dir))  # per-step losses on device: no host sync per step

    def save() -> None:
        if window.safe_to_save(model):
            extra = {**(checkpoint_extra or {}), "train_loss": result.train_loss}
            pt.save_checkpoint(checkpoint_dir, model, optimizer, scheduler, extra, keep_checkpoints,  # type: ignore[arg-type]
                               asynchronous=checkpoint_async)

    if checkpoint_dir or stop_dir:  # what a stop signal saves, at the step every rank stops at
        pt.save_on_stop(checkpoint_dir or stop_dir, model, optimizer, scheduler,  # type: ignore[arg-type]
                        lambda: {**(checkpoint_extra or {}), "train_loss": result.train_loss}, keep_checkpoints)
    try:
        while pt.global_step < total:
            model.train()
            for batch in run.timed(meter.timed(loader)):
                window.add(pt.training_step(model, batch, loss_fn))  # loss_fn(model(x), y); pt.backward(loss)
                optimizer.step()
                if pt.micro_step:  # mid-accumulation: the global batch is not complete yet
                    continue
                lr = optimizer.param_groups[0]["lr"]  # the step's, before the scheduler moves it on
                if scheduler is not None:
                    scheduler.step()
                bar.update()
                if pt.global_step % log_every == 0 or pt.global_step >= total:
                    steps = pt.global_step - window.start
                    result.train_loss = window.mean()  # one all-reduce per log line, on every rank alike
                    record = {"step": pt.global_step, "loss": result.train_loss, "lr": lr,
                              **meter.summary(steps * pt.global_batch, steps),
                              "loss_scale": pt.loss_scale, "skipped_steps": pt.skipped_steps}
                    logger.log(record)
                    bar.set_postfix(loss=f"{result.train_loss:.4f}")
                    meter.reset()
                    window.check()  # NaN/inf for max_nonfinite_steps steps in a row: stop, after logging it
                if checkpoint_dir and checkpoint_every and pt.global_step % checkpoint_every == 0:
                    save()
                if on_step is not None:
                    on_step(pt)
                if pt.global_step >= total or pt.should_stop:  # should_stop: one all-reduce per step
                    break
            if pt.should_stop:
                result.preempted = True
                break
            if evaluator is not None:
                with meter.paused(), run.paused():
                    result.eval = pt.evaluate(model, evaluator, loss_fn)
                    logger.log({"step": pt.global_step, **result.eval}, kind="eval")
        done = pt.global_step - first_step  # throughput of this whole call, evaluation excluded
        result.throughput = run.summary(done * pt.global_batch, done)
        if not result.preempted:
            _finish(pt, window, model, evaluator, loss_fn, logger, result, save if checkpoint_dir and done and not (
                checkpoint_every and pt.global_step % checkpoint_every == 0) else None)
        wait_for_checkpoint()  # one written in the background is complete (or its failure raised) when fit returns
    finally:
        bar.close()
    result.steps, result.skipped_steps = pt.global_step, pt.skipped_steps
    return result


def _finish(pt: Parallel, window: LossWindow, model: nn.Module, evaluator: Any, loss_fn: Any, logger: RunLogger,
            result: FitResult, save: Callable[[], None] | None) -> None:
    """The end of a run that was not stopped: checks, the last evaluation and checkpoint."""
    window.finish(model)  # the last loss and the weights are finite, or this raises
    if evaluator is not None and not result.eval:  # resumed at the end: evaluate what is there
        result.eval = pt.evaluate(model, evaluator, loss_fn)
        logger.log({"step": pt.global_step, **result.eval}, kind="eval")
    if save is not None:
        save()


def _total(steps_per_epoch: int, epochs: int, max_steps: int | None) -> int:
    return min(epochs * steps_per_epoch, max_steps or epochs * steps_per_epoch)


def planned_steps(pt: Parallel, train_set: Dataset, epochs: int = 1, max_steps: int | None = None) -> int:
    """The global step at which ``fit`` with these arguments stops."""
    if isinstance(train_set, IterableDataset):
        return _stream_steps(max_steps)
    return _total(pt.steps_per_epoch(train_set), epochs, max_steps)


def _stream_steps(max_steps: int | None) -> int:
    if not max_steps:
        raise ValueError("a stream (IterableDataset) has no known number of steps per epoch: give fit max_steps "
                         "(paratrain train: --max-steps N)")
    return max_steps
