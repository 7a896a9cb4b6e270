"""World-size invariance: paratrain ddp at 1, 2 and 4 processes == a plain one-process PyTorch loop."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain

N, GLOBAL_BATCH, EPOCHS, SEED, LR = 128, 32, 6, 3, 0.05  # 4 steps/epoch x 6 epochs = 24 steps


def make_data():
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, 1, 6, 6, generator=g)
    y = torch.randint(0, 4, (N,), generator=g)
    return x, y


def make_model(kind):
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(36, 32), nn.ReLU(), nn.Linear(32, 4))
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4),
    )


def reference(kind, accumulation=1):
    """Plain PyTorch, one process: the loop the user had before paratrain."""
    x, y = make_data()
    torch.manual_seed(SEED)
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    micro = GLOBAL_BATCH // accumulation
    for epoch in range(EPOCHS):
        # paratrain's documented epoch order: randperm seeded by (seed, epoch)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
        for s in range(N // GLOBAL_BATCH):
            idx = perm[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]
            opt.zero_grad()
            for a in range(accumulation):
                i = idx[a * micro:(a + 1) * micro]
                (nn.functional.cross_entropy(model(x[i]), y[i]) / accumulation).backward()
            opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def paratrain_worker(local_rank, kind, accumulation, micro_batch=None):
    pt = paratrain.Parallel(strategy="ddp", global_batch=GLOBAL_BATCH, seed=SEED, accumulation=accumulation,
                            micro_batch=micro_batch, sync_batchnorm=(kind == "cnn"))
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, opt = pt.setup(model, opt)
    loader = pt.train_loader(TensorDataset(*make_data()))
    for _ in range(EPOCHS):
        for xb, yb in loader:
            opt.zero_grad()
            pt.backward(nn.functional.cross_entropy(model(xb), yb))
            opt.step()
    assert pt.global_step == EPOCHS * (N // GLOBAL_BATCH)
    state = {k: v.detach().clone() for k, v in pt.unwrap(model).state_dict().items()}
    pt.close()
    return state


def assert_close_states(got, ref, rtol=1e-5):
    assert got.keys() == ref.keys()
    for k in ref:
        if ref[k].is_floating_point():
            err = ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item()
            assert err <= rtol, f"{k}: relative error {err:.2e} > {rtol}"
        else:
            assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ddp_matches_single_process_reference(kind, world):
    ref = reference(kind)
    states = paratrain.launch(paratrain_worker, nprocs=world, args=(kind, None), timeout=120)
    for state in states:  # every rank holds the same model
        assert_close_states(state, ref)


def test_accumulation_8x4_equals_batch_32():
    ref = reference("mlp", accumulation=1)
    # micro-batch 8 x 4 accumulation steps on one process, and 8 x 2 steps on each of 2 ranks.
    (single,) = paratrain.launch(paratrain_worker, nprocs=1, args=("mlp", None, 8), timeout=60)
    assert_close_states(single, ref)
    states = paratrain.launch(paratrain_worker, nprocs=2, args=("mlp", 2), timeout=60)
    assert_close_states(states[0], ref)


def hooks_worker(local_rank, hook, options):
    pt = paratrain.Parallel(strategy="ddp", global_batch=GLOBAL_BATCH, seed=SEED, ddp={"comm_hook": hook, **options})
    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, opt = pt.setup(model, opt)
    loader = pt.train_loader(TensorDataset(*make_data()), num_workers=1, persistent_workers=True)
    for _ in range(EPOCHS):
        for xb, yb in loader:
            opt.zero_grad()
            pt.backward(nn.functional.cross_entropy(model(xb), yb))
            opt.step()
    state = pt.full_state_dict(model)
    pt.close()
    return state


@pytest.mark.parametrize("hook, options, rtol", [
    ("none", {"static_graph": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 0.001}, 1e-5),
    ("fp16", {}, 1e-2),      # gradients travel in fp16: close, not equal
    ("powersgd", {"powersgd_start_iter": 2}, 0.5),  # low-rank approximation: it trains, differently
])
def test_ddp_options_and_comm_hooks(hook, options, rtol):
    """DDP's options pass through (exact, with DataLoader workers too); compression hooks stay close."""
    ref = reference("mlp")
    states = paratrain.launch(hooks_worker, nprocs=2, args=(hook, options), timeout=120)
    assert_close_states(states[0], ref, rtol=rtol)
    assert_close_states(states[1], states[0], rtol=0)  # replicas never drift apart
