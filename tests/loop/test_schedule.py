"""``[optim] schedule``: constant, cosine, linear and step after a linear warmup, checked step by
step against torch's own schedulers; invalid settings are one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain.config import OptimConfig
from paratrain.loop import build_schedule, lr_factor
from clitools import run_cli

LR, TOTAL, WARMUP = 0.4, 20, 4


def lrs(make_scheduler, steps=TOTAL):
    """The lr of each of ``steps`` optimizer steps under ``make_scheduler(optimizer)``."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = make_scheduler(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def warmup_then(after):
    """torch's own composition: LinearLR from 1/WARMUP to 1, then ``after`` (our reference)."""
    def make(opt):
        ramp = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / WARMUP, end_factor=1.0, total_iters=WARMUP - 1)
        return torch.optim.lr_scheduler.SequentialLR(opt, [ramp, after(opt)], milestones=[WARMUP])
    return make


REFERENCES = {
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=TOTAL - WARMUP, eta_min=0.1 * LR),
    "linear": lambda opt: torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=TOTAL - WARMUP),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "constant": lambda opt: torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0),
}


@pytest.mark.parametrize("schedule", list(REFERENCES))
@pytest.mark.parametrize("warmup", [0, WARMUP])
def test_schedule_matches_torch_schedulers(schedule, warmup):
    ours = lrs(lambda opt: build_schedule(opt, schedule=schedule, total_steps=TOTAL, warmup_steps=warmup,
                                          step_size=3, gamma=0.5, min_lr_ratio=0.1)
               or torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0))
    if warmup:
        reference = lrs(warmup_then(REFERENCES[schedule]))
    else:  # no warmup: the decay spans every step
        reference = lrs({**REFERENCES, "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=TOTAL, eta_min=0.1 * LR), "linear": lambda opt: torch.optim.lr_scheduler.LinearLR(
            opt, 1.0, 0.1, total_iters=TOTAL)}[schedule])
    # the closed form (ours) and torch's recursive/chainable forms differ by float rounding only
    assert ours == pytest.approx(reference, rel=1e-9, abs=1e-12)


def test_linear_scaling_multiplies_every_schedule():
    scaled = lrs(lambda opt: build_schedule(opt, schedule="cosine", total_steps=TOTAL, global_batch=64, base_batch=16))
    assert scaled[0] == pytest.approx(4 * LR) and scaled[-1] == pytest.approx(4 * LR * lr_factor(TOTAL - 1, schedule="cosine", total_steps=TOTAL))


def test_constant_unscaled_lr_needs_no_scheduler():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    assert build_schedule(opt, schedule="constant", total_steps=10) is None


@pytest.mark.parametrize("kwargs, needle", [
    (dict(schedule="exponential"), "schedule 'exponential' is unknown: use one of constant, cosine, linear, step"),
    (dict(schedule="step"), "schedule 'step' needs step_size >= 1 (got 0)"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio 1.5 must be between 0 and 1"),
    (dict(schedule="step", step_size=2, gamma=0.0), "gamma 0.0 must be in (0, 1]"),
])
def test_bad_schedule_settings_name_the_value(kwargs, needle):
    with pytest.raises(ValueError) as info:
        OptimConfig(**kwargs)
    assert needle in str(info.value)


@pytest.mark.timeout(90)
def test_train_cli_steps_the_configured_schedule(tmp_path):
    res = run_cli(["train", "--max-steps", "6", "--set", "log_every=1", "--no-progress", "--log-dir", str(tmp_path),
                   "--lr", "0.1", "--warmup-steps", "2", "--schedule", "step", "--set", "optim.step_size=2",
                   "--set", "optim.gamma=0.5"], timeout=80)
    assert res.returncode == 0, res.stderr[-3000:]
    logged = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    # the lr each step used (its loss is the row's): step s (from 1) used factor s - 1
    expected = [0.1 * lr_factor(s, schedule="step", warmup_steps=2, step_size=2, gamma=0.5) for s in range(0, 6)]
    assert [r["lr"] for r in logged] == pytest.approx(expected)


def test_scaled_lr_warms_up_from_the_base_lr():
    """Goyal et al.'s gradual warmup: k = 64/16 = 4; the lr starts at the base lr and rises by a
    constant (k-1)/W per step to k x lr at step W; then the schedule (cosine) from k x lr."""
    w = 4
    got = lrs(lambda opt: build_schedule(opt, schedule="cosine", total_steps=TOTAL, warmup_steps=w,
                                        global_batch=64, base_batch=16))
    assert got[:w] == pytest.approx([LR * (1 + 3 * s / w) for s in range(w)])
    assert got[w:] == pytest.approx([4 * LR * lr_factor(s, schedule="cosine", total_steps=TOTAL, warmup_steps=w)
                                     for s in range(w, TOTAL)])
    # an unscaled lr still warms up from lr / W
    plain = lrs(lambda opt: build_schedule(opt, schedule="constant", total_steps=TOTAL, warmup_steps=w))
    assert plain[:w] == pytest.approx([LR * (s + 1) / w for s in range(w)])
