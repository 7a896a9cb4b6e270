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


# --- item 5: the own loop's mistakes, each in one line before anything diverges -------------------
def _regression(n: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ torch.randn(4, 3, generator=g)).argmax(1))


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def mistakes(local_rank: int = 0, strategy: str = "single") -> dict[str, object]:
    """The mistakes of issue 27 in one run of a user's loop; what each ends in."""
    out: dict[str, object] = {}
    pt = paratrain.Parallel(strategy=strategy, global_batch=8, seed=1)
    torch.manual_seed(0)
    # a model and optimizer never given to setup, with pt.backward and pt.train_loader
    net = nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xb, yb = next(iter(pt.train_loader(_regression())))
    out["never set up"] = _error(lambda: pt.backward(nn.functional.cross_entropy(net(xb), yb)))
    out["weights"] = net.weight.detach().clone()  # every rank's, to check that nothing diverged
    # an optimizer over another model's parameters
    other = nn.Linear(4, 3)
    out["another model's optimizer"] = _error(lambda: pt.setup(net, torch.optim.SGD(other.parameters(), lr=0.1)))
    model, opt = pt.setup(net, opt)
    # setup twice: the same model, or what setup returned
    out["setup twice"] = _error(lambda: pt.setup(net))
    out["setup what setup returned"] = _error(lambda: pt.setup(model))
    # a loss of another model than the one set up
    out["loss of a model not set up"] = _error(lambda: pt.backward(nn.functional.cross_entropy(other(xb), yb)))
    pt.backward(nn.functional.cross_entropy(model(xb), yb))  # the loop as it should be
    opt.step()
    # the user's own DataLoader given to evaluate: each sample counted once
    testset = _regression(64)
    own = pt.evaluate(model, torch.utils.data.DataLoader(testset, batch_size=8))
    sharded = pt.evaluate(model, pt.eval_loader(testset, batch_size=8))
    out["evaluate"] = (own["count"], own == sharded)
    pt.close()
    return out


@pytest.fixture(scope="module")
def mistakes_by_world() -> dict[int, list[dict[str, object]]]:
    return {1: [mistakes()], 2: paratrain.launch(mistakes, nprocs=2, args=("ddp",), timeout=180)}


FIX = "model, optimizer = pt.setup(model, optimizer)"


@pytest.mark.parametrize("world", [1, 2])
def test_a_model_never_set_up_is_refused_at_the_first_backward(world, mistakes_by_world) -> None:
    """On main, at world size 2, the replicas diverged and the run stopped later with 'backward called
    2 times without an optimizer step'."""
    for r in mistakes_by_world[world]:
        assert r["never set up"].startswith("pt.backward: no model was set up") and FIX in r["never set up"]
        assert r["loss of a model not set up"].startswith("pt.backward: the loss depends on no parameter of a "
                                                          "model pt.setup returned") and FIX in r["loss of a model not set up"]
        assert torch.equal(r["weights"], mistakes_by_world[world][0]["weights"])  # nothing diverged


@pytest.mark.parametrize("world", [1, 2])
def test_setup_twice_and_an_optimizer_of_another_model_are_refused(world, mistakes_by_world) -> None:
    for r in mistakes_by_world[world]:
        assert r["setup twice"].startswith("setup: this Linear was set up before")
        assert r["setup what setup returned"].startswith("setup: this model is what pt.setup returned")
        assert r["another model's optimizer"].startswith("setup: the optimizer holds none of this Linear's "
                                                         "parameters")
        assert all("\n" not in r[k] for k in ("setup twice", "setup what setup returned", "another model's optimizer"))


@pytest.mark.parametrize("world", [1, 2])
def test_evaluate_shards_the_users_own_dataloader(world, mistakes_by_world) -> None:
    """On main, at world size 2, every sample counted twice (count 128 for 64 samples)."""
    for r in mistakes_by_world[world]:
        assert r["evaluate"] == (64, True)
