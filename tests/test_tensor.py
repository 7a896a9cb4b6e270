"""tensor (DTensor tensor parallelism, alone and with FSDP on a 2-D mesh) == a plain one-process loop."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.strategies.tensor import TensorOptions, auto_plan

N, GLOBAL_BATCH, STEPS, SEED, LR, CLIP = 64, 16, 5, 11, 0.05, 0.5


class Block(nn.Module):
    """Pre-norm MLP block of a transformer: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Stack(nn.Module):
    """A small transformer-ish stack over sequences: embed, 2 blocks, mean-pool, head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(12, 16)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)).mean(1))


def make_model(kind):
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(36, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
    return Stack()


def make_data(kind):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 6, 6, generator=g) if kind == "mlp" else torch.randn(N, 5, 12, generator=g)
    return x, torch.randint(0, 4, (N,), generator=g)


def reference(kind, accumulation=1, clip=None):
    """Plain PyTorch, one process, the same global batches (paratrain's seeded epoch order)."""
    x, y = make_data(kind)
    torch.manual_seed(SEED)
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    micro = GLOBAL_BATCH // accumulation
    for step in range(STEPS):
        epoch, s = divmod(step, N // GLOBAL_BATCH)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
        idx = perm[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        for a in range(accumulation):
            i = idx[a * micro:(a + 1) * micro]
            (nn.functional.cross_entropy(model(x[i]), y[i]) / accumulation).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    with torch.no_grad():
        eval_loss = nn.functional.cross_entropy(model(x), y).item()
    return {k: v.clone() for k, v in model.state_dict().items()}, eval_loss


def tp_run(kind, tp_size=None, accumulation=None, clip=None):
    from paratrain.checkpoint.sharded import full_state_dict

    pt = paratrain.Parallel(strategy="tensor", global_batch=GLOBAL_BATCH, seed=SEED, accumulation=accumulation,
                            clip_grad_norm=clip, tensor={"tp_size": tp_size})
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, opt = pt.setup(model, opt)
    dataset = TensorDataset(*make_data(kind))
    loader = pt.train_loader(dataset)
    first_batch = None
    while pt.global_step < STEPS:
        for xb, yb in loader:
            first_batch = xb.clone() if first_batch is None else first_batch
            opt.zero_grad()
            out = model(xb)
            assert type(out) is torch.Tensor and out.shape == (len(xb), 4)  # full, replicated logits
            pt.backward(nn.functional.cross_entropy(out, yb))
            opt.step()
            if pt.global_step == STEPS:
                break
    metrics = pt.evaluate(model, pt.eval_loader(dataset, batch_size=8))
    state = {k: v.detach().clone() for k, v in full_state_dict(model).items()}
    return {"state": state, "eval": metrics, "first_batch": first_batch,
            "dp": (pt.strategy.data_parallel_size, pt.strategy.data_parallel_rank, pt.plan.world_size)}


def error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def bad_combinations():
    """The one-line errors, from inside a real world of 2."""
    def setup(model, **tensor):
        pt = paratrain.Parallel(strategy="tensor", global_batch=GLOBAL_BATCH, tensor=tensor)
        pt.setup(model)

    return {
        "indivisible world": error_of(lambda: setup(make_model("mlp"), tp_size=3)),
        "no linear": error_of(lambda: setup(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten()))),
        "odd features": error_of(lambda: setup(nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 2)))),
        "not a linear": error_of(lambda: setup(nn.Sequential(nn.Linear(8, 4), nn.ReLU()), plan={"1": "colwise"})),
    }


def tp_worker(rank, runs, check_errors):
    out = [tp_run(*run) for run in runs]  # one launch, several runs: starting processes is the slow part
    errors = bad_combinations() if check_errors else None
    paratrain.destroy()
    return out, errors


def assert_close_states(got, ref, rtol=1e-5):
    assert got.keys() == ref.keys()
    for k in ref:
        err = ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item()
        assert err <= rtol, f"{k}: relative error {err:.2e} > {rtol}"


def test_tensor_parallel_matches_reference_and_errors_are_one_line():
    runs = [("mlp",), ("stack", None, None, CLIP)]
    outs = paratrain.launch(tp_worker, nprocs=2, args=(runs, True), timeout=90)
    refs = [reference("mlp"), reference("stack", clip=CLIP)]
    for results, _ in outs:
        for got, (ref, ref_eval) in zip(results, refs):
            assert_close_states(got["state"], ref)
            assert got["eval"]["count"] == N and got["eval"]["loss"] == pytest.approx(ref_eval, rel=1e-5)
            assert got["dp"] == (1, 0, 1)  # both ranks split the same batch
    errors = outs[0][1]
    assert errors == outs[1][1]
    assert errors["indivisible world"] == (
        "tensor: world size 2 is not divisible by tp_size 3: use a tp_size that divides 2")
    assert errors["no linear"].startswith("tensor: the model (Sequential) has no nn.Linear layer to parallelize")
    assert errors["odd features"] == "tensor: Linear '0' (colwise) has out_features 5, not divisible by tp_size 2"
    assert errors["not a linear"] == "tensor plan names '1', which is not an nn.Linear of the model"
    assert all("\n" not in e for e in errors.values())


def test_tensor_2d_mesh_dp2_tp2_matches_reference():
    outs = paratrain.launch(tp_worker, nprocs=4, args=([("stack", 2, 2, CLIP)], False), timeout=120)
    ref, ref_eval = reference("stack", accumulation=2, clip=CLIP)
    for rank, ((got,), _) in enumerate(outs):
        assert_close_states(got["state"], ref)
        # the sampler shards over dp only: 2 data-parallel ranks, tp ranks 0,1 (and 2,3) share a batch
        assert got["dp"] == (2, rank // 2, 2)
        assert got["eval"]["count"] == N and got["eval"]["loss"] == pytest.approx(ref_eval, rel=1e-5)
    batches = [o[0][0]["first_batch"] for o in outs]
    assert torch.equal(batches[0], batches[1]) and torch.equal(batches[2], batches[3])
    assert not torch.equal(batches[0], batches[2])


def test_auto_plan_pairs_linears_around_activations():
    assert auto_plan(make_model("mlp")) == {"1": "colwise", "3": "rowwise"}
    pairs = (("fc1", "colwise"), ("fc2", "rowwise"))
    assert auto_plan(Stack()) == {f"blocks.{i}.{name}": style for i in (0, 1) for name, style in pairs}


def test_tensor_options_validate():
    assert TensorOptions(plan="a=colwise, b=rowwise").plan == {"a": "colwise", "b": "rowwise"}
    with pytest.raises(ValueError, match="tp_size 0 must be at least 1"):
        TensorOptions(tp_size=0)
    with pytest.raises(ValueError, match="'diagonal' is unknown"):
        TensorOptions(plan={"fc": "diagonal"})
    cfg = paratrain.ParallelConfig(strategy="tensor", tensor={"tp_size": "2"})
    assert cfg.tensor == TensorOptions(tp_size=2)
