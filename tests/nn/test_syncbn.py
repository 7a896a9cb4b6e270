"""paratrain.nn.SyncBatchNorm: N gloo ranks on CPU give the single-process BatchNorm result."""

import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import paratrain
from pace import scaled
from paratrain.nn import SyncBatchNorm, convert_sync_batchnorm, has_unsynced_batchnorm
from paratrain.nn import syncbn as syncbn_module
from parity import FLOAT64_RTOL, relative_error

F64 = torch.float64
STEPS = 3
C = 3
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
SHAPE = {1: (), 2: (5, 5), 3: (2, 3, 2)}


def _make_bn(dim, momentum, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    bn = BN[dim](C, momentum=momentum)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(C, generator=g) + 0.5)
        bn.bias.copy_(torch.randn(C, generator=g))
    return bn.to(dtype)


def _batch(dim, n, step, dtype=torch.float32):
    """Input (offset mean, to exercise the variance formula) and fixed loss weights for one step
    (float64 casts the same float32 values)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n, C, *SHAPE[dim], generator=g) * 2.0 + 3.0
    return x.to(dtype), torch.randn(x.shape, generator=g).to(dtype)


def _run(bn, dim, n, world, rank, dtype=torch.float32):
    """STEPS forward/backward passes on this rank's slice; loss = sum(out * w) over the slice.
    No optimizer: nothing feeds back, so rounding is not amplified from step to step."""
    outs, xgrads = [], []
    for step in range(STEPS):
        x, w = _batch(dim, n, step, dtype)
        xs = x.tensor_split(world)[rank].clone().requires_grad_()
        out = bn(xs)
        (out * w.tensor_split(world)[rank]).sum().backward()
        outs.append(out.detach())
        xgrads.append(xs.grad)
    return {
        "out": outs, "xgrad": xgrads, "wgrad": bn.weight.grad, "bgrad": bn.bias.grad,
        "running_mean": bn.running_mean.clone(), "running_var": bn.running_var.clone(),
        "num_batches_tracked": int(bn.num_batches_tracked),
    }


def _train_worker(local_rank, configs):
    d = paratrain.init(timeout_s=30)
    results = []
    for dim, momentum, n, dtype in configs:
        bn = convert_sync_batchnorm(_make_bn(dim, momentum, dtype))
        assert type(bn) is SyncBatchNorm
        results.append(_run(bn, dim, n, d.world_size, d.rank, dtype))
    # bf16 input: statistics in float32, output in the input dtype.
    x, _ = _batch(2, 8, 0)
    bn = convert_sync_batchnorm(_make_bn(2, 0.1))
    xs = x.tensor_split(d.world_size)[d.rank]
    results.append((bn(xs.bfloat16()), bn(xs)))
    paratrain.destroy()
    return results


# (BatchNorm dims, momentum, global batch, dtype); float64 layers compute their statistics in float64.
CONFIGS = {
    2: [(2, 0.1, 16, torch.float32), (2, None, 16, torch.float32), (1, 0.1, 16, torch.float32),
        (3, 0.1, 8, torch.float32), (2, 0.1, 16, F64), (3, None, 8, F64)],
    3: [(2, 0.1, 10, torch.float32), (1, None, 10, torch.float32), (1, 0.1, 10, F64)],
}


@pytest.fixture(scope="module")
def launched():
    return {world: paratrain.launch(_train_worker, nprocs=world, args=(cfgs,), timeout=90)
            for world, cfgs in CONFIGS.items()}


# float32: the synced statistics are summed in another order than one BatchNorm's (per-rank
# var_mean, combined in float64), a ~1e-7 relative difference that these forward/backward passes
# do not amplify (nothing is trained). Measured: outputs, input gradients and running stats use
# <= 2.5% of this tolerance (<= 5e-7 absolute on values up to 5); the reference with 1 vs 2
# threads <= 5% (tests/test_parity_conditioning.py).
# float64: measured <= 3e-15 absolute, 0.1% of the tolerance; atol covers elements near 0.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), F64: dict(rtol=FLOAT64_RTOL, atol=1e-12)}


def _close(actual, expected):
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])


@pytest.mark.parametrize("world,index", [(w, i) for w, cfgs in CONFIGS.items() for i in range(len(cfgs))])
def test_sync_matches_single_process_batchnorm(launched, world, index):
    dim, momentum, n, dtype = CONFIGS[world][index]
    ref = _run(_make_bn(dim, momentum, dtype), dim, n, world=1, rank=0, dtype=dtype)
    ranks = [r[index] for r in launched[world]]
    for rank, got in enumerate(ranks):
        for step in range(STEPS):
            _close(got["out"][step], ref["out"][step].tensor_split(world)[rank])
            _close(got["xgrad"][step], ref["xgrad"][step].tensor_split(world)[rank])
        _close(got["running_mean"], ref["running_mean"])
        _close(got["running_var"], ref["running_var"])
        assert got["num_batches_tracked"] == STEPS
    # A weight/bias gradient sums out * w over the whole batch (400 terms up to ~10 each, for values
    # down to 2.5): its rounding is relative to the vector, not to one cancelled element. Measured
    # <= 1.9e-7 (float32) and 1.1e-15 (float64) relative to the norm.
    for g in ("wgrad", "bgrad"):
        assert relative_error(sum(r[g] for r in ranks), ref[g]) <= TOLERANCE[dtype]["rtol"], g


def test_sync_bf16_input_returns_bf16(launched):
    for out_bf16, out_fp32 in (r[-1] for r in launched[2]):
        assert out_bf16.dtype == torch.bfloat16 and out_fp32.dtype == torch.float32
        # bf16 keeps 8 significant bits: the input and the output are each rounded by up to
        # 2**-8 relative, on outputs up to ~4 (measured max difference 1.6e-2)
        torch.testing.assert_close(out_bf16.float(), out_fp32, rtol=0.05, atol=0.05)


def _eval_worker(local_rank):
    d = paratrain.init(timeout_s=15)
    bn = convert_sync_batchnorm(_make_bn(2, 0.1))
    x, _ = _batch(2, 8, 0)
    bn(x.tensor_split(2)[d.rank])  # one synced training step: both ranks
    if d.rank != 0:
        paratrain.destroy()
        return None  # rank 1 is gone: any collective on rank 0 would now fail or hang
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        bn.eval()
        start = time.monotonic()
        with torch.no_grad():
            out = bn(x)
        elapsed = time.monotonic() - start
    finally:
        dist.all_reduce = real
    expected = F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    paratrain.destroy()
    return out, expected, len(calls), elapsed


def test_eval_does_no_collective():
    out, expected, calls, elapsed = paratrain.launch(_eval_worker, nprocs=2, timeout=60)[0]
    assert calls == 0 and elapsed < scaled(5)  # a rank waiting on a collective would wait out its timeout
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # evaluation is F.batch_norm itself: bit for bit


@pytest.mark.parametrize("momentum", [0.1, None])
def test_single_process_equals_batchnorm(momentum):
    assert not dist.is_initialized()
    ref = _run(_make_bn(2, momentum), 2, 16, world=1, rank=0)
    got = _run(convert_sync_batchnorm(_make_bn(2, momentum)), 2, 16, world=1, rank=0)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    x, _ = _batch(2, 4, 9)
    ref_bn, bn = _make_bn(2, momentum), convert_sync_batchnorm(_make_bn(2, momentum))
    for dtype in (torch.float32, torch.bfloat16):
        out = bn(x.to(dtype))
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref_bn(x.to(dtype)), rtol=0, atol=0)  # a world of one runs nn.BatchNorm's code
    ref_bn.eval(), bn.eval()
    torch.testing.assert_close(bn(x), ref_bn(x), rtol=0, atol=0)


def test_convert_preserves_state_and_flags():
    model = nn.Sequential(nn.Conv2d(3, C, 1), _make_bn(2, 0.1), nn.Sequential(nn.BatchNorm1d(4, affine=False)))
    model[1].running_mean.add_(0.5)
    model[1].num_batches_tracked.fill_(7)
    model[1].bias.requires_grad_(False)
    model[1].qconfig = "qc"
    model[2][0].eval()
    before = copy.deepcopy(model.state_dict())
    converted = convert_sync_batchnorm(model)
    assert type(converted[1]) is SyncBatchNorm and type(converted[2][0]) is SyncBatchNorm
    after = converted.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    assert converted[1].qconfig == "qc" and not converted[1].bias.requires_grad and converted[1].weight.requires_grad
    assert converted[1].training and not converted[2][0].training
    assert converted[2][0].weight is None and not converted[2][0].affine
    single = convert_sync_batchnorm(nn.BatchNorm3d(2, eps=1e-3, momentum=None, track_running_stats=False))
    assert type(single) is SyncBatchNorm and single.eps == 1e-3 and single.momentum is None
    assert single.running_mean is None and single(torch.randn(2, 2, 2, 2, 2)).shape == (2, 2, 2, 2, 2)


def test_convert_leaves_synced_layers_and_delegates_cuda(monkeypatch):
    synced = SyncBatchNorm(C)
    assert convert_sync_batchnorm(synced) is synced
    torch_synced = nn.SyncBatchNorm(C)
    assert convert_sync_batchnorm(torch_synced) is torch_synced
    monkeypatch.setattr(syncbn_module, "_on_cuda", lambda m: True)
    assert type(convert_sync_batchnorm(nn.BatchNorm2d(C))) is nn.SyncBatchNorm


def test_has_unsynced_batchnorm():
    assert has_unsynced_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    assert has_unsynced_batchnorm(nn.BatchNorm3d(2))
    assert not has_unsynced_batchnorm(convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))))
    assert not has_unsynced_batchnorm(nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2), SyncBatchNorm(2)))
    assert not has_unsynced_batchnorm(nn.Sequential(nn.Conv2d(2, 2, 1), nn.InstanceNorm2d(2), nn.LayerNorm(2)))
