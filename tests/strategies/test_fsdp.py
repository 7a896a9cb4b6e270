"""fsdp (FSDP2 fully_shard) == a plain one-process PyTorch loop; sharded checkpoints reshard."""

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.strategies.fsdp import FSDPOptions
from parity import FLOAT64_RTOL, Problem, assert_same_state, mlp, run_paratrain, teacher_data

F64 = torch.float64
# 3 blocks with parameters (sharded one by one) + parameter-free activations.
make_model = functools.partial(mlp, 12, 16, 16, 4)
# 6 steps. Measured on the float32 reference (tests/test_parity_conditioning.py): 1 vs 2 threads and
# float32 vs float64 <= 3e-7 (so 1e-5, >= 10x).
PROBLEM = Problem(make_model, functools.partial(teacher_data, 96, (12,), seed=7), global_batch=16, steps=6, seed=5,
                  lr=0.05, momentum=0.9, rtol=1e-5)
ACCUMULATED = PROBLEM.replace(accumulation=2, clip=0.5)  # clip 0.5: below the gradient norm, so it acts
PROBLEMS = {"mlp": PROBLEM, "mlp, accumulation 2, clip": ACCUMULATED}


def train(pt, model, opt, steps, problem=PROBLEM):
    loader = pt.train_loader(TensorDataset(*problem.data()))
    target = pt.global_step + steps
    while pt.global_step < target:
        for xb, yb in loader:
            opt.zero_grad()
            pt.backward(nn.functional.cross_entropy(model(xb), yb))
            opt.step()
            if pt.global_step == target and pt.micro_step == 0:
                break


def full_state(model):
    from paratrain.checkpoint.sharded import full_state_dict

    return {k: v.detach().clone() for k, v in full_state_dict(model).items()}


def sharded(pt, model, opt):
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in model.parameters())
    # the optimizer built before setup was rebuilt over the sharded parameters
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]


def fsdp_run(options, problem):
    return run_paratrain(problem, "fsdp", fsdp=options, before=sharded,
                         after=lambda pt, model, opt: {"bytes": pt.strategy.parameter_bytes(pt.unwrap(model))})


def scheduler_not_given_to_setup():
    """A warmup schedule built on the optimizer before setup, and stepped by the user, not passed
    to setup (transformers' get_linear_schedule_with_warmup habit): the lr that steps follows it."""
    pt = paratrain.Parallel(strategy="fsdp", global_batch=PROBLEM.global_batch, seed=PROBLEM.seed)
    model = PROBLEM.model()
    user_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(user_opt, lambda step: min(1.0, step / 2))  # lr 0 at step 0
    model, opt = pt.setup(model, user_opt)
    lrs = []
    for xb, yb in pt.train_loader(TensorDataset(*PROBLEM.data())):
        opt.zero_grad()
        pt.backward(nn.functional.cross_entropy(model(xb), yb))
        opt.step()
        sched.step()
        lrs.append(pt._clock.optimizers[-1].param_groups[0]["lr"])  # the optimizer that steps the shards
        if len(lrs) == 3:
            break
    return {"lrs": lrs, "same_object": pt._clock.optimizers[-1] is user_opt}


def fsdp_worker(rank, runs):
    # Several configurations in one launch: starting processes is the slow part of these tests.
    out = [fsdp_run(*run) for run in runs] + [scheduler_not_given_to_setup()]
    paratrain.destroy()
    return out


def test_fsdp_matches_reference_shards_parameters_and_accumulates():
    runs = [({"reshard_after_forward": True}, PROBLEM),  # ZeRO-3
            ({"reshard_after_forward": False}, PROBLEM),  # ZeRO-2-like
            ({}, ACCUMULATED),  # accumulation 2 + gradient clipping of DTensor gradients
            ({}, ACCUMULATED.replace(dtype=F64))]  # the same in float64: equal to rounding, 1e-10
    outs = paratrain.launch(fsdp_worker, nprocs=2, args=(runs,), timeout=90)
    ref, ref_accumulated = PROBLEM.reference().state, ACCUMULATED.reference().state
    ref64 = ACCUMULATED.replace(dtype=F64).reference().state
    for zero3, zero2, accumulated, accumulated64, scheduled in outs:
        assert scheduled == {"lrs": [0.05, 0.1, 0.1], "same_object": True}
        assert_same_state(zero3["state"], ref, PROBLEM.rtol)
        assert_same_state(zero2["state"], ref, PROBLEM.rtol)
        assert_same_state(accumulated["state"], ref_accumulated, ACCUMULATED.rtol)
        assert_same_state(accumulated64["state"], ref64, FLOAT64_RTOL)
    # Each rank holds about half the parameter bytes; together exactly the whole model.
    local = [o[0]["bytes"]["local"] for o in outs]
    full = outs[0][0]["bytes"]["full"]
    assert sum(local) == full and all(abs(b - full / 2) <= 0.1 * full for b in local), (local, full)


def ckpt_run(path, save):
    """save: 3 steps, save, 3 more steps. load: load the step-3 checkpoint, 3 more steps."""
    from paratrain.checkpoint.sharded import load_sharded, save_sharded

    pt = paratrain.Parallel(strategy="fsdp", global_batch=PROBLEM.global_batch, seed=PROBLEM.seed)
    model = PROBLEM.model()
    opt = PROBLEM.optimizer(model.parameters())
    model, opt = pt.setup(model, opt)
    if save:
        train(pt, model, opt, 3)
        with pytest.raises(TypeError):  # extra must be plain data: refused before anything is written
            save_sharded(path, model, opt, {"step": object()})
        save_sharded(path, model, opt, {"step": pt.global_step})
    else:
        extra = load_sharded(path, model, opt)
        pt.global_step = extra["step"]  # the data position: the loader resumes mid-epoch
    restored = full_state(model)
    train(pt, model, opt, 3)
    return {"at_save": restored, "final": full_state(model), "step": pt.global_step}


def ckpt_worker(rank, path, phases):
    out = [ckpt_run(path, save) for save in phases]
    paratrain.destroy()
    return out


def test_sharded_checkpoint_resumes_on_same_and_other_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    # world 2: save (fsdp shards), then load into a fresh fsdp model in the same processes.
    outs = paratrain.launch(ckpt_worker, nprocs=2, args=(path, (True, False)), timeout=90)
    assert (tmp_path / "ckpt" / ".metadata").is_file() and not (tmp_path / "ckpt.tmp").exists()
    run = outs[0][0]
    assert_same_state(run["final"], PROBLEM.reference().state, PROBLEM.rtol)  # 3 + 3 = PROBLEM.steps
    # world 1: the same checkpoint into a plain, unsharded model (DCP reshards 2 -> 1).
    (single,) = paratrain.launch(ckpt_worker, nprocs=1, args=(path, (False,)), timeout=90)
    for out in [o[1] for o in outs] + single:
        assert out["step"] == 6
        for k in run["at_save"]:  # parameters restored exactly
            assert torch.equal(out["at_save"][k], run["at_save"][k]), k
        # momentum restored too: the resumed run ends where the uninterrupted one ended (the
        # same world size does the same arithmetic; world 1 sums gradients in another order)
        assert_same_state(out["final"], run["final"], PROBLEM.rtol)


def test_fsdp_options_validate():
    assert FSDPOptions(wrap_classes="Block, Attention").wrap_classes == ["Block", "Attention"]
    with pytest.raises(ValueError, match="min_params -1 must be >= 0"):
        FSDPOptions(min_params=-1)
    cfg = paratrain.ParallelConfig(strategy="fsdp", fsdp={"reshard_after_forward": "false", "min_params": "100"})
    assert cfg.fsdp == FSDPOptions(reshard_after_forward=False, min_params=100)


def test_block_selection():
    from paratrain.strategies.fsdp import _blocks

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    model = nn.Sequential(Block(), nn.ReLU(), Block(), nn.Linear(8, 2))
    assert _blocks(model, [], 0) == [model[0], model[2], model[3]]
    assert _blocks(model, ["Block"], 0) == [model[2], model[0]]  # innermost/last first
    # 72 parameters per Linear(8, 8): each Linear is a block; Linear(8, 2) (18) is left to the root
    assert _blocks(model, [], 70) == [model[0].fc1, model[0].fc2, model[2].fc1, model[2].fc2]
