"""The step rules of ``paratrain.clock.StepClock``, played without a process group or a ``Parallel``.

Each test drives the clock as a loop drives ``Parallel``: ``clock.backward(run)`` per micro-batch,
``ParallelOptimizer.step()`` (``clock.step``) after it. ``apply`` records which optimizer stepped,
and whether it was the one that ended the global batch.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from paratrain.clock import StepClock
from paratrain.wrappers import ParallelOptimizer, ParallelScheduler


def make(accumulation: int = 1, *names: str) -> tuple[StepClock, list[tuple[str, bool]], dict[str, ParallelOptimizer]]:
    """A clock, the log of its applied steps, and one wrapped SGD optimizer per name."""
    applied: list[tuple[str, bool]] = []

    def apply(optimizer: torch.optim.Optimizer, ends_batch: bool) -> bool:
        applied.append((optimizer.name, ends_batch))  # type: ignore[attr-defined]
        optimizer.step()
        return True

    clock = StepClock(accumulation, apply)
    optimizers = {}
    for name in names or ("opt",):
        inner = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        inner.name = name  # type: ignore[attr-defined]
        clock.optimizers.append(inner)
        optimizers[name] = ParallelOptimizer(inner, clock)
    return clock, applied, optimizers


def backward(clock: StepClock, *optimizers: ParallelOptimizer) -> None:
    """One micro-batch: gradients for ``optimizers``' parameters (all, if none named)."""
    def run(divisor: int) -> None:
        for opt in optimizers:
            for p in opt.param_groups[0]["params"]:
                p.grad = torch.ones_like(p) / divisor if p.grad is None else p.grad + 1 / divisor
    clock.backward(run)


def test_accumulation_steps_once_per_global_batch() -> None:
    clock, applied, opts = make(3)
    opt = opts["opt"]
    for step in range(2):
        for micro in range(3):
            assert clock.micro_step == micro and clock.last_micro_step == (micro == 2)
            backward(clock, opt)
            assert opt.step() is (micro == 2)
        assert clock.global_step == step + 1 and clock.micro_step == 0
    assert applied == [("opt", True)] * 2
    assert opt.param_groups[0]["params"][0].grad is None  # cleared after the step


def test_a_backward_too_many_is_refused() -> None:
    clock, _, opts = make(2)
    backward(clock, opts["opt"])
    backward(clock, opts["opt"])
    with pytest.raises(RuntimeError, match="backward called 3 times without an optimizer step, but accumulation is 2"):
        backward(clock, opts["opt"])


def test_zero_grad_never_wipes_gradients_mid_accumulation() -> None:
    clock, _, opts = make(2)
    opt = opts["opt"]
    backward(clock, opt)
    opt.zero_grad()
    assert opt.param_groups[0]["params"][0].grad is not None
    opt.step()
    backward(clock, opt)
    opt.step()
    opt.zero_grad()
    assert opt.param_groups[0]["params"][0].grad is None


def test_several_optimizers_after_one_backward_all_step_and_the_first_ends_the_batch() -> None:
    clock, applied, opts = make(2, "a", "b")
    a, b = opts["a"], opts["b"]
    for _ in range(2):
        for _micro in range(2):
            backward(clock, a, b)
            a.step()
            b.step()
    assert applied == [("a", True), ("b", False)] * 2
    assert clock.global_step == 2


def test_gan_rounds_move_the_global_step_once_per_round() -> None:
    clock, applied, opts = make(1, "d", "g")
    d, g = opts["d"], opts["g"]
    for round_ in range(3):
        backward(clock, d)
        d.step()
        assert clock.global_step == round_ + 1  # the discriminator ends the round's first batch
        backward(clock, g)
        g.step()
        assert clock.global_step == round_ + 1  # the generator's batch is the same round
    assert applied == [("d", True), ("g", True)] * 3


def test_gan_rounds_with_accumulation_are_refused() -> None:
    clock, _, opts = make(2, "d", "g")
    d, g = opts["d"], opts["g"]
    backward(clock, d)
    d.step()  # early: mid-accumulation
    backward(clock, g)
    with pytest.raises(ValueError, match="two optimizers step after backward calls of their own"):
        g.step()


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_a_gradscaler_skip_ends_the_global_batch_and_is_counted() -> None:
    clock, applied, opts = make(1)
    opt = opts["opt"]
    driven = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    clock.drive(driven, opt.optimizer)
    backward(clock, opt)
    assert clock.scaled_step(opt.optimizer, torch.tensor(1.0), None) is False  # inf found: skipped
    assert (clock.global_step, clock.scaler_skips, applied) == (1, 1, [])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # a skipped step still steps the driven scheduler
    backward(clock, opt)
    p = opt.param_groups[0]["params"][0]
    assert clock.scaled_step(opt.optimizer, torch.tensor(0.0), torch.tensor(4.0)) is True
    assert applied == [("opt", True)] and clock.global_step == 2
    assert torch.equal(p.detach(), torch.full((2,), 1 - 0.05 * 0.25))  # gradient 1 unscaled by 4, lr 0.05


def test_a_gradscaler_with_accumulation_is_refused() -> None:
    clock, _, opts = make(2)
    with pytest.raises(ValueError, match="your own GradScaler with accumulation 2"):
        clock.scaled_step(opts["opt"].optimizer, torch.tensor(0.0), None)


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_a_scheduler_moved_mid_accumulation_is_reported_once() -> None:
    clock, _, opts = make(2)
    opt = opts["opt"]
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)  # the user's own, not wrapped
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            for _micro in range(2):
                backward(clock, opt)
                opt.step()
                sched.step()  # per micro-batch: wrong under accumulation
    moved = [w for w in seen if "learning rate changed in the middle of an accumulation" in str(w.message)]
    assert len(moved) == 1 and moved[0].filename == __file__  # once, at the loop's optimizer.step()


def test_a_wrapped_scheduler_steps_once_per_optimizer_step() -> None:
    clock, _, opts = make(2)
    opt = opts["opt"]
    sched = ParallelScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), clock)
    assert clock.schedulers == [sched]
    for _ in range(3):
        for _micro in range(2):
            backward(clock, opt)
            opt.step()
            sched.step()  # per micro-batch, as without accumulation
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_restore_continues_at_a_global_batch_start_and_schedulers_follow() -> None:
    clock, _, opts = make(2)
    opt = opts["opt"]
    sched = ParallelScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), clock)
    backward(clock, opt)
    clock.restore(7)
    assert (clock.global_step, clock.micro_step) == (7, 0)
    sched.step()  # no optimizer step since step 7: nothing
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    backward(clock, opt)
    backward(clock, opt)
    opt.step()
    sched.step()
    assert clock.global_step == 8 and opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_gradients_edited_between_micro_steps_are_reported_once() -> None:
    clock, _, opts = make(2)
    opt = opts["opt"]
    p = opt.param_groups[0]["params"][0]

    def run(divisor: int) -> None:
        p.grad = torch.ones_like(p) / divisor if p.grad is None else p.grad + 1 / divisor

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            clock.backward(run, lambda: [p])
            p.grad.mul_(0.5)  # a clip in the loop body: acts on half the global batch
            clock.backward(run, lambda: [p])
            opt.step()
    edited = [w for w in seen if "gradients changed between micro-batches 1 and 2" in str(w.message)]
    assert len(edited) == 1
