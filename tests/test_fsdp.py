"""fsdp (FSDP2 fully_shard) == a plain one-process PyTorch loop; sharded checkpoints reshard."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.strategies.fsdp import FSDPOptions

N, GLOBAL_BATCH, STEPS, SEED, LR, CLIP = 96, 16, 6, 5, 0.05, 0.5


def make_data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, 12, generator=g), torch.randint(0, 4, (N,), generator=g)


def make_model():
    # 3 blocks with parameters (sharded one by one) + a parameter-free activation.
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def reference(steps, accumulation=1, clip=None):
    """Plain PyTorch, one process, the same global batches (paratrain's seeded epoch order)."""
    x, y = make_data()
    torch.manual_seed(SEED)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    micro = GLOBAL_BATCH // accumulation
    per_epoch = N // GLOBAL_BATCH
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
        idx = perm[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        for a in range(accumulation):
            i = idx[a * micro:(a + 1) * micro]
            (nn.functional.cross_entropy(model(x[i]), y[i]) / accumulation).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def train(pt, model, opt, steps):
    loader = pt.train_loader(TensorDataset(*make_data()))
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


def fsdp_run(options, accumulation=None, clip=None):
    pt = paratrain.Parallel(strategy="fsdp", global_batch=GLOBAL_BATCH, seed=SEED, accumulation=accumulation,
                            clip_grad_norm=clip, fsdp=options)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, opt = pt.setup(model, opt)
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in model.parameters())
    # the optimizer built before setup was rebuilt over the sharded parameters
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
    train(pt, model, opt, STEPS)
    return {"state": full_state(model), "bytes": pt.strategy.parameter_bytes(pt.unwrap(model))}


def fsdp_worker(rank, runs):
    # Several configurations in one launch: starting processes is the slow part of these tests.
    out = [fsdp_run(*run) for run in runs]
    paratrain.destroy()
    return out


def assert_close_states(got, ref, rtol=1e-5):
    assert got.keys() == ref.keys()
    for k in ref:
        err = ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item()
        assert err <= rtol, f"{k}: relative error {err:.2e} > {rtol}"


def test_fsdp_matches_reference_shards_parameters_and_accumulates():
    runs = [({"reshard_after_forward": True}, None, None),  # ZeRO-3
            ({"reshard_after_forward": False}, None, None),  # ZeRO-2-like
            ({}, 2, CLIP)]  # accumulation 2 + gradient clipping of DTensor gradients
    outs = paratrain.launch(fsdp_worker, nprocs=2, args=(runs,), timeout=90)
    ref = reference(STEPS)
    for zero3, zero2, accumulated in outs:
        assert_close_states(zero3["state"], ref)
        assert_close_states(zero2["state"], ref)
        assert_close_states(accumulated["state"], reference(STEPS, accumulation=2, clip=CLIP))
    # Each rank holds about half the parameter bytes; together exactly the whole model.
    local = [o[0]["bytes"]["local"] for o in outs]
    full = outs[0][0]["bytes"]["full"]
    assert sum(local) == full and all(abs(b - full / 2) <= 0.1 * full for b in local), (local, full)


def ckpt_run(path, save):
    """save: 3 steps, save, 3 more steps. load: load the step-3 checkpoint, 3 more steps."""
    from paratrain.checkpoint.sharded import load_sharded, save_sharded

    pt = paratrain.Parallel(strategy="fsdp", global_batch=GLOBAL_BATCH, seed=SEED)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
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
    assert_close_states(run["final"], reference(6))
    # world 1: the same checkpoint into a plain, unsharded model (DCP reshards 2 -> 1).
    (single,) = paratrain.launch(ckpt_worker, nprocs=1, args=(path, (False,)), timeout=90)
    for out in [o[1] for o in outs] + single:
        assert out["step"] == 6
        for k in run["at_save"]:  # parameters restored exactly
            assert torch.equal(out["at_save"][k], run["at_save"][k]), k
        # momentum restored too: the resumed run ends where the uninterrupted one ended
        assert_close_states(out["final"], run["final"])


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
