"""What ``pt.setup`` returns, used as a user's own loop uses it (issue 27): a torch LR scheduler built
on the returned optimizer follows the optimizer steps (item 4), and the loop's common mistakes end in
one line naming the fix, at world size 1 and 2, before any replica diverges (item 5)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import paratrain

pytestmark = pytest.mark.timeout(240)

ACCUMULATION, STEPS = 4, 6  # optimizer steps of each run; the scheduler is stepped after every micro-batch
SCHEDULERS = ["hf_linear_warmup", "onecycle", "cosine", "plateau", "sequential", "chained"]


def build_scheduler(kind: str, opt: torch.optim.Optimizer):
    sched = torch.optim.lr_scheduler
    if kind == "hf_linear_warmup":  # HuggingFace's: a LambdaLR
        from transformers import get_linear_schedule_with_warmup

        return get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)
    if kind == "onecycle":
        return sched.OneCycleLR(opt, max_lr=0.5, total_steps=STEPS)
    if kind == "cosine":
        return sched.CosineAnnealingLR(opt, T_max=STEPS)
    if kind == "plateau":  # stepped on a metric that never improves: the lr halves every optimizer step
        return sched.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    if kind == "sequential":
        return sched.SequentialLR(opt, [sched.LinearLR(opt, start_factor=0.25, total_iters=3),
                                        sched.StepLR(opt, step_size=2, gamma=0.5)], milestones=[3])
    if kind == "chained":
        return sched.ChainedScheduler([sched.ExponentialLR(opt, gamma=0.9), sched.StepLR(opt, step_size=2, gamma=0.5)])
    raise ValueError(kind)


def step(kind: str, scheduler) -> None:
    scheduler.step(1.0) if kind == "plateau" else scheduler.step()


def reference_lrs(kind: str) -> list[float]:
    """Plain PyTorch: the scheduler stepped once per optimizer step."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler, lrs = build_scheduler(kind, opt), []
    for _ in range(STEPS):
        opt.step()
        step(kind, scheduler)
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def paratrain_lrs(kinds: list[str], strategy: str) -> dict[str, object]:
    """Each scheduler built on the optimizer ``setup`` returned (not given to ``setup``) and stepped
    after every ``optimizer.step()``, i.e. per micro-batch: the lr after each optimizer step."""
    out: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind in kinds:  # a run each (the Parallel objects of a process share its process group)
            pt = paratrain.Parallel(strategy=strategy, global_batch=2 * ACCUMULATION * pt_world(),
                                    accumulation=ACCUMULATION)
            torch.manual_seed(0)
            net = nn.Linear(4, 2).double()
            model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            scheduler, lrs = build_scheduler(kind, opt), []
            x = torch.randn(2, 4, dtype=torch.float64)
            for _ in range(STEPS * ACCUMULATION):
                opt.zero_grad()
                pt.backward(model(x).pow(2).mean())
                opt.step()
                step(kind, scheduler)
                if pt.micro_step == 0:
                    lrs.append(opt.param_groups[0]["lr"])
            out[kind] = lrs
    out["warnings"] = [str(w.message) for w in caught if "lr" in str(w.message) or "learning rate" in str(w.message)]
    pt.close()
    return out


def pt_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _worker(local_rank: int, kinds: list[str]) -> dict[str, object]:
    return paratrain_lrs(kinds, "ddp")


def kinds_here() -> list[str]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return SCHEDULERS[1:]
    return SCHEDULERS


@pytest.mark.parametrize("world", [1, 2])
def test_a_scheduler_built_on_the_setup_optimizer_steps_once_per_optimizer_step(world: int) -> None:
    """accumulation 4: the lr after each of 6 optimizer steps equals plain PyTorch's with the
    scheduler stepped once per step (on main: 4 scheduler steps per optimizer step, or OneCycleLR's
    'stepped too many times')."""
    kinds = kinds_here()
    results = [paratrain_lrs(kinds, "single")] if world == 1 else paratrain.launch(_worker, nprocs=2, args=(kinds,),
                                                                                   timeout=180)
    for r in results:
        assert r["warnings"] == []
        for kind in kinds:
            assert r[kind] == pytest.approx(reference_lrs(kind), rel=1e-12), kind


def test_a_scheduler_given_to_register_scheduler_or_setup_is_not_stepped_twice() -> None:
    """Built on the returned optimizer, then registered: paratrain steps it, once per optimizer step."""
    pt = paratrain.Parallel(global_batch=4, accumulation=2)
    net = nn.Linear(4, 2)
    model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    scheduler = pt.register_scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    for _ in range(4):
        opt.zero_grad()
        pt.backward(model(torch.ones(2, 4)).sum())
        opt.step()
    assert (scheduler.last_epoch, opt.param_groups[0]["lr"]) == (2, 0.1 * 0.25)
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR  # a plain scheduler again: paratrain drives it
    pt.close()
