"""Mixed precision on CPU: fp16 loss scaling (dynamic and static), overflow skips, bf16, aliases;
plus overflow agreement under DDP and distributed evaluation that counts each sample once."""

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from parity import global_batches, relative_error, teacher_data

INF = float("inf")


def tiny_model():
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def tiny_batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    # small inputs keep scaled fp16 gradients (scale 2**16) clear of fp16's 65504 maximum
    return torch.randn(n, 6, generator=g) * 0.1, torch.randint(0, 3, (n,), generator=g)


def inject_inf(param):
    """A backward hook that puts +inf into one element of ``param``'s gradient (once)."""

    def hook(grad):
        grad = grad.clone()
        grad.view(-1)[0] = INF
        return grad

    return param.register_hook(hook)


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def unchanged(model, snap):
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), snap))


def train_step(pt, model, opt, x, y, poison=None):
    opt.zero_grad()
    handle = inject_inf(poison) if poison is not None else None
    pt.backward(nn.functional.cross_entropy(model(x), y))
    if handle is not None:
        handle.remove()
    return opt.step()


# --- fp16-mixed, dynamic GradScaler -------------------------------------------------------------
def test_fp16_dynamic_scaler_skips_overflow_and_lowers_scale():
    pt = paratrain.Parallel(strategy="single", precision="fp16-mixed", global_batch=8)
    assert pt.precision.name == "fp16-mixed" and pt.precision.scaler is not None
    model = tiny_model()
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = tiny_batch()

    # autocast really runs the layers in fp16; the wrapped model hands back fp32
    inner = []
    h = pt.unwrap(model)[0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    out = model(x)
    h.remove()
    assert inner == [torch.float16] and out.dtype == torch.float32

    scale0 = pt.precision.loss_scale
    before = snapshot(model)
    assert train_step(pt, model, opt, x, y, poison=pt.unwrap(model)[2].weight) is False
    assert unchanged(model, before)
    assert pt.skipped_steps == 1
    assert pt.precision.loss_scale < scale0
    assert pt.global_step == 1
    assert all(p.grad is None for p in model.parameters()), "gradients of a skipped step must not leak"

    scale1 = pt.precision.loss_scale
    for _ in range(3):
        before = snapshot(model)
        assert train_step(pt, model, opt, x, y) is True
        assert not unchanged(model, before)
    assert pt.skipped_steps == 1
    assert pt.precision.loss_scale == scale1  # no growth before 2000 clean steps
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_dynamic_step_reads_the_device_once_and_never_after_the_optimizer_step(monkeypatch):
    # On a GPU each Tensor.item() waits for the work queued before it: reading the scale after
    # optimizer.step() (get_scale) would wait for the whole step before the next forward is queued.
    pt = paratrain.Parallel(strategy="single", precision="fp16-mixed", global_batch=8)
    model = tiny_model()
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = tiny_batch()
    events = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: events.append("item") or item(t))
    inner = opt.optimizer  # the user's optimizer inside paratrain's
    step = inner.step
    monkeypatch.setattr(inner, "step", lambda *a, **k: events.append("step") or step(*a, **k))
    for poison in (None, pt.unwrap(model)[2].weight, None):
        events.clear()
        opt.zero_grad()
        handle = inject_inf(poison) if poison is not None else None
        pt.backward(nn.functional.cross_entropy(model(x), y))
        if handle is not None:
            handle.remove()
        taken = opt.step()
        assert taken is (poison is None)
        # GradScaler.step's own read follows ours with nothing queued between: one wait a step
        assert events == (["item", "item", "step"] if taken else ["item", "item"]), events
    assert pt.skipped_steps == 1


def test_fp16_with_a_fused_optimizer_never_waits_for_the_device_and_skips_as_plain_pytorch(monkeypatch):
    # AdamW(fused=True) skips an overflowed step in its own kernel from GradScaler's flag: PyTorch's AMP loop
    # then never waits for the device, and neither does paratrain's step (the wait cost GPT-2 4.5% on an H200)
    def run(ours):
        torch.manual_seed(0)
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        if ours:
            pt = paratrain.Parallel(strategy="single", precision="fp16-mixed", global_batch=8, clip_grad_norm=1.0)
            model, opt = pt.setup(model, opt)
        else:
            scaler = torch.amp.GradScaler("cpu")
        plain = model if not ours else pt.unwrap(model)
        taken, reads = [], []
        item = torch.Tensor.item
        for i, (x, y) in enumerate(tiny_batch(seed=s) for s in range(4)):
            handle = inject_inf(plain[2].weight) if i == 1 else None
            if ours:
                pt.backward(nn.functional.cross_entropy(model(x), y))
            else:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
            if handle is not None:
                handle.remove()
            monkeypatch.setattr(torch.Tensor, "item", lambda t, i=i: reads.append(i) or item(t))
            if ours:
                taken.append(opt.step())
            else:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
            monkeypatch.setattr(torch.Tensor, "item", item)
            opt.zero_grad()
        return plain, taken, reads, (pt.skipped_steps if ours else None)

    ref, _, plain_reads, _ = run(False)
    model, taken, reads, skipped = run(True)
    assert reads == plain_reads == [], (reads, plain_reads)  # no host read of a device value during a step
    assert isinstance(taken[0], paratrain.precision.Stepped)
    assert taken == [True, False, True, True] and [bool(t) for t in taken] == [True, False, True, True]
    assert skipped == 1
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), (p - q).abs().max()


# --- fp16-mixed, static loss scale --------------------------------------------------------------
def test_fp16_static_scale_is_fixed_and_skips_overflow():
    pt = paratrain.Parallel(strategy="single", precision="fp16-mixed", global_batch=8, loss_scale=128.0)
    assert pt.precision.scaler is None and pt.precision.loss_scale == 128.0
    model = tiny_model()
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = tiny_batch()

    for _ in range(2):
        before = snapshot(model)
        assert train_step(pt, model, opt, x, y) is True
        assert not unchanged(model, before)
        assert pt.precision.loss_scale == 128.0

    before = snapshot(model)
    assert train_step(pt, model, opt, x, y, poison=pt.unwrap(model)[0].weight) is False
    assert unchanged(model, before)
    assert pt.skipped_steps == 1
    assert pt.precision.loss_scale == 128.0

    before = snapshot(model)
    assert train_step(pt, model, opt, x, y) is True
    assert not unchanged(model, before)
    assert pt.skipped_steps == 1
    assert pt.precision.loss_scale == 128.0


def test_fp16_static_scale_optimizer_sees_unscaled_gradients():
    pt = paratrain.Parallel(strategy="single", precision="fp16-mixed", global_batch=8, loss_scale=128.0)
    model = tiny_model()
    reference = copy.deepcopy(model)  # plain fp32 copy, same weights
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([p.grad.detach().clone() for p in model.parameters()]))
    model, opt = pt.setup(model, opt)
    x, y = tiny_batch(seed=1)
    x = x * 10  # unit-scale inputs: gradients well above fp16 rounding noise

    assert train_step(pt, model, opt, x, y) is True
    ref_opt.zero_grad()
    nn.functional.cross_entropy(reference(x), y).backward()
    ref_grads = [p.grad.clone() for p in reference.parameters()]
    ref_opt.step()

    assert len(seen) == 1
    for got, want in zip(seen[0], ref_grads):
        # unscaled: a forgotten 1/128 would be off by 128x. fp16 forward/backward rounds by 2**-11
        # relative per operation: measured <= 1.5e-4 absolute on gradients up to 0.33, so
        # atol 2e-3 + rtol 1e-2 is >= 10x that and still 100x below a scale error.
        torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-3)
    for p, q in zip(model.parameters(), reference.parameters()):
        # one lr-0.5 step of those gradients: measured <= 8e-5 absolute on weights up to 0.4
        torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-3)


# --- bf16-mixed ---------------------------------------------------------------------------------
def test_bf16_mixed_trains_and_returns_fp32():
    pt = paratrain.Parallel(strategy="single", precision="bf16-mixed", global_batch=16, seed=1)
    assert pt.precision.name == "bf16-mixed"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    w = torch.randn(6, 3, generator=g)
    y = (x @ w).argmax(1)  # learnable: a linear rule
    model = tiny_model()
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9))
    loader = pt.train_loader(TensorDataset(x, y))

    inner = []
    h = pt.unwrap(model)[0].register_forward_hook(lambda m, i, o: inner.append(o.dtype))
    with torch.no_grad():
        out = model(x)
    h.remove()
    assert inner == [torch.bfloat16]
    assert out.dtype == torch.float32

    def full_loss():
        with torch.no_grad():
            return nn.functional.cross_entropy(model(x), y).item()

    start = full_loss()
    losses = []
    while pt.global_step < 30:
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            assert loss.dtype == torch.float32
            pt.backward(loss)
            assert opt.step() is True
            losses.append(loss.item())
            if pt.global_step == 30:
                break
    assert pt.skipped_steps == 0
    end = full_loss()
    assert end < 0.6 * start, (start, end)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5


# --- bf16-true / fp16-true: low-precision weights, fp32 master weights -----------------------
# Learnable labels and lr 0.05: DDP's bf16 gradient all-reduce then stays within 1.6e-3 of one
# process (lr 0.5 on random labels: 1.2e-2, against a 2e-2 tolerance).
MASTER_N, MASTER_BATCH, MASTER_LR, MASTER_SEED = 48, 8, 0.05, 1
master_data = functools.partial(teacher_data, MASTER_N, (6,), classes=3, seed=9)


def master_weights_run(strategy, steps, precision="bf16-true", ckpt=None, resume=False, clip=None):
    """``steps`` optimizer steps of paratrain; checkpoints every 2 steps into ``ckpt`` if given."""
    pt = paratrain.Parallel(strategy=strategy, precision=precision, global_batch=MASTER_BATCH, seed=MASTER_SEED,
                            clip_grad_norm=clip)
    torch.manual_seed(MASTER_SEED)
    model = tiny_model()
    inner = model
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=MASTER_LR, momentum=0.9))
    if resume:
        pt.load_checkpoint(ckpt, model, opt)
    loader = pt.train_loader(TensorDataset(*master_data()))
    for xb, yb in loader:
        if pt.global_step == steps:
            break
        train_step(pt, model, opt, xb, yb)
        if ckpt and not resume and pt.global_step % 2 == 0:
            pt.save_checkpoint(ckpt, model, opt)
    masters = opt.param_groups[0]["params"]  # the optimizer steps the fp32 masters
    return {"params": snapshot(inner), "masters": pt.precision.masters_state(),
            "momentum": [opt.state[m]["momentum_buffer"].clone() for m in masters]}


def master_weights_reference(steps, clip=None):
    """Plain PyTorch: a bf16 model, its fp32 master copy stepped by the optimizer, rounded back."""
    x, y = master_data()
    torch.manual_seed(MASTER_SEED)
    model = tiny_model()
    masters = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = torch.optim.SGD(masters, lr=MASTER_LR, momentum=0.9)
    for i in global_batches(MASTER_N, MASTER_BATCH, MASTER_SEED, steps):  # paratrain's epoch order
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x[i])
        model.zero_grad()
        nn.functional.cross_entropy(out.float(), y[i]).backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, clip)  # on the fp32 gradients
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
    return snapshot(model), masters


def test_under_pt_autocast_outputs_stay_as_autocast_made_them_and_the_loss_is_the_same():
    """Issue 38: a loss outside autocast gets fp32 outputs (an fp32 copy of the logits: paratrain single
    at 0.916x of nanoGPT's loop on an H200); under ``pt.autocast()``, as nanoGPT's ``with ctx:``, the outputs stay bf16 and
    cross-entropy's autocast reads them into fp32 itself: the same loss and gradients (the bf16 values
    are exact in fp32), without the copy. fp32 has no autocast: outputs as they are either way; bf16-true's
    come back fp32 outside and bf16 inside."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    pt = paratrain.Parallel(strategy="single", precision="bf16-mixed", global_batch=16, seed=1)
    model = pt.setup(tiny_model())
    assert model(x).dtype == torch.float32
    grads = []
    for under in (False, True):
        model.zero_grad()
        if under:
            with pt.autocast():
                out = model(x)
                loss = nn.functional.cross_entropy(out, y)
            assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
        else:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_out, g_out), (loss_in, g_in) = grads
    assert relative_error(loss_in, loss_out) <= 1e-6
    assert max(relative_error(a, b) for a, b in zip(g_in, g_out)) <= 1e-6
    fp32 = paratrain.Parallel(strategy="single", precision="32", global_batch=16, seed=1)
    with fp32.autocast():
        assert fp32.setup(tiny_model())(x).dtype == torch.float32
    true = paratrain.Parallel(strategy="single", precision="bf16-true", global_batch=16, seed=1)
    model = true.setup(tiny_model())
    assert model(x).dtype == torch.float32
    with true.autocast():
        assert model(x).dtype == torch.bfloat16


def test_the_built_in_step_computes_its_own_losses_under_autocast_and_yours_in_fp32():
    """``pt.training_step`` with cross-entropy (or token_loss, marked ``fp32_loss``) runs forward and loss under
    the precision's autocast: the model hands bf16 logits to the loss, the loss is the one fp32 outputs give.
    A loss of the user's own gets fp32 outputs, as before."""
    from paratrain.precision import computes_in_fp32, fp32_loss
    from paratrain.models.gpt import token_loss

    assert computes_in_fp32(nn.functional.cross_entropy) and computes_in_fp32(token_loss)
    assert not computes_in_fp32(lambda out, y: out.sum()) and not computes_in_fp32(nn.functional.mse_loss)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    seen = []
    own = lambda out, t: (seen.append(out.dtype), nn.functional.cross_entropy(out, t))[1]  # noqa: E731
    marked = fp32_loss(lambda out, t: (seen.append(out.dtype), nn.functional.cross_entropy(out, t))[1])
    for fn in (nn.functional.cross_entropy, own, marked):
        torch.manual_seed(0)
        pt = paratrain.Parallel(strategy="single", precision="bf16-mixed", global_batch=16, seed=1)
        model = pt.setup(tiny_model())
        with torch.no_grad():
            want = nn.functional.cross_entropy(model(x), y)  # fp32 outputs, the loss outside autocast
        loss = pt.training_step(model, (x, y), fn)
        assert model.module[0].weight.grad is not None and relative_error(loss, want) <= 1e-6
        pt.close()
    assert seen == [torch.float32, torch.bfloat16]  # yours: fp32 outputs; a marked one: what autocast made


@pytest.mark.parametrize("clip", [None, 0.05])
def test_bf16_true_is_a_bf16_model_stepped_through_fp32_masters(clip):
    run = master_weights_run("single", 5, clip=clip)
    ref_params, ref_masters = master_weights_reference(5, clip)
    assert all(p.dtype == torch.bfloat16 for p in run["params"])
    assert all(m.dtype == torch.float32 for m in run["masters"] + run["momentum"])
    for got, ref in zip(run["params"] + run["masters"], ref_params + ref_masters):
        assert torch.equal(got, ref)
    # the masters carry what bf16 rounds away
    assert any(not torch.equal(m, p.float()) for m, p in zip(run["masters"], run["params"]))


def test_master_weights_resume_exactly(tmp_path):
    for precision in ("bf16-true", "fp16-true"):
        full = master_weights_run("single", 6, precision)
        master_weights_run("single", 5, precision, ckpt=str(tmp_path / precision))  # last checkpoint: step 4
        resumed = master_weights_run("single", 6, precision, ckpt=str(tmp_path / precision), resume=True)
        for key in ("params", "masters", "momentum"):
            for a, b in zip(full[key], resumed[key]):
                assert torch.equal(a, b), (precision, key)


def test_a_checkpoint_of_another_precision_resumes_into_master_weights(tmp_path):
    """Written in fp32 (no masters), resumed in bf16-true: the masters start from the loaded weights
    (an lr-0 step copies them back unchanged), not from the fresh model's."""
    pt = paratrain.Parallel(strategy="single", precision="32", global_batch=8)
    net = tiny_model()
    model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.0))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    pt.save_checkpoint(str(tmp_path), model, opt)
    pt = paratrain.Parallel(strategy="single", precision="bf16-true", global_batch=8)
    net = tiny_model()
    model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.0))
    pt.load_checkpoint(str(tmp_path), model, opt)
    x, y = tiny_batch()
    assert train_step(pt, model, opt, x, y)
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())


def test_fp16_true_scales_skips_overflow_and_keeps_fp16_weights():
    pt = paratrain.Parallel(strategy="single", precision="O2", global_batch=8)
    model = tiny_model()
    inner = model
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = tiny_batch()
    scale = pt.precision.loss_scale
    assert train_step(pt, model, opt, x, y) and pt.precision.loss_scale == scale
    before = snapshot(inner)
    assert not train_step(pt, model, opt, x, y, poison=inner[2].weight)  # overflow: skipped, scale halved
    assert unchanged(inner, before) and pt.skipped_steps == 1 and pt.precision.loss_scale == scale / 2
    assert train_step(pt, model, opt, x, y) and not unchanged(inner, before)
    assert all(p.dtype == torch.float16 for p in inner.parameters())
    assert all(s["momentum_buffer"] is None or s["momentum_buffer"].dtype == torch.float32 for s in opt.state.values())


def test_weights_loaded_after_setup_become_the_masters():
    pt = paratrain.Parallel(strategy="single", precision="bf16-true", global_batch=8)
    model = tiny_model()
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    torch.manual_seed(42)
    new = tiny_model().state_dict()
    model.load_state_dict(new)  # e.g. pretrained weights, after setup
    x, y = tiny_batch()
    assert train_step(pt, model, opt, x, y)  # lr 0: the masters, copied back, must be the new weights
    for k, v in model.state_dict().items():
        assert torch.equal(v, new[k].to(torch.bfloat16)), k


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline", "ps"])
def test_master_weights_refused_where_parameters_are_not_plain(strategy):
    with pytest.raises(ValueError, match=f"precision bf16-true .* is not supported with strategy {strategy}") as e:
        paratrain.ParallelConfig(strategy=strategy, precision="bf16-true", global_batch=8)
    assert "\n" not in str(e.value)


# --- names and validation -----------------------------------------------------------------------
@pytest.mark.parametrize("name,canonical", [("O0", "32"), ("O1", "fp16-mixed"), ("O2", "fp16-true"),
                                            ("O3", "fp16-true"), ("bf16", "bf16-mixed"), ("16-mixed", "fp16-mixed")])
def test_apex_aliases(name, canonical):
    pt = paratrain.Parallel(precision=name, global_batch=8)
    assert pt.precision.name == canonical
    assert pt.config.precision == canonical


def test_unknown_precision_is_named():
    with pytest.raises(ValueError, match="fp8-mixed"):
        paratrain.Parallel(precision="fp8-mixed", global_batch=8)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32"])
def test_loss_scale_only_for_fp16(precision):
    with pytest.raises(ValueError, match="loss_scale"):
        paratrain.Parallel(precision=precision, global_batch=8, loss_scale=128.0)
    with pytest.raises(ValueError, match="loss scale"):
        paratrain.precision.build(precision, torch.device("cpu"), 128.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, INF, float("nan")])
def test_static_scale_must_be_positive_finite(bad):
    with pytest.raises(ValueError, match="loss scale"):
        paratrain.Parallel(precision="fp16-mixed", global_batch=8, loss_scale=bad)


# --- DDP: an overflow on one rank skips the step on every rank ----------------------------------
def overflow_on_rank_1_worker(local_rank):
    results = {}
    for loss_scale in (None, 128.0):
        pt = paratrain.Parallel(strategy="ddp", precision="fp16-mixed", global_batch=8, loss_scale=loss_scale)
        model = tiny_model()
        inner = model
        model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = tiny_batch(n=32, seed=4)
        loader = pt.train_loader(TensorDataset(x, y))
        stepped, scales, changed = [], [], []
        for i, (xb, yb) in enumerate(loader):  # 4 steps of 4 samples per rank
            poison = inner[2].weight if (i == 1 and pt.rank == 1) else None
            before = snapshot(inner)
            stepped.append(train_step(pt, model, opt, xb, yb, poison=poison))
            changed.append(not unchanged(inner, before))
            scales.append(pt.precision.loss_scale)
        results[loss_scale] = dict(
            stepped=stepped, changed=changed, scales=scales, skipped=pt.skipped_steps,
            state=[p.detach().clone() for p in inner.parameters()],
        )
    return results


def two_rank_worker(local_rank):
    # One 2-process launch serves both 2-rank tests: starting workers (torch + DDP imports) is the slow part.
    overflow = overflow_on_rank_1_worker(local_rank)
    master = master_weights_run("ddp", 5)
    evaluation = eval_worker(local_rank)  # closes the process group
    return {"overflow": overflow, "eval": evaluation, "master": master}


@pytest.fixture(scope="module")
def two_ranks():
    return paratrain.launch(two_rank_worker, nprocs=2, timeout=90)


def test_ddp_fp16_overflow_on_one_rank_skips_everywhere(two_ranks):
    ranks = [r["overflow"] for r in two_ranks]
    for loss_scale in (None, 128.0):
        r0, r1 = ranks[0][loss_scale], ranks[1][loss_scale]
        for r in (r0, r1):
            assert r["stepped"] == [True, False, True, True], (loss_scale, r["stepped"])
            assert r["changed"] == [True, False, True, True]
            assert r["skipped"] == 1
        assert r0["scales"] == r1["scales"]
        if loss_scale is None:
            s = r0["scales"]
            assert s[1] == s[0] / 2 and s[2] == s[1] and s[3] == s[1]
        else:
            assert r0["scales"] == [128.0] * 4
        for p, q in zip(r0["state"], r1["state"]):
            assert torch.equal(p, q)
            assert torch.isfinite(p).all()


def test_ddp_bf16_true_ranks_agree_and_follow_single(two_ranks):
    # DDP all-reduces bf16 gradients (8 significant bits), so it is close to, not equal to, one
    # process: measured 1.6e-3 after 5 steps (a weight one bf16 step apart is 2**-8 = 3.9e-3 off).
    single = master_weights_run("single", 5)
    r0, r1 = (r["master"] for r in two_ranks)
    for key in ("params", "masters"):
        for a, b, c in zip(r0[key], r1[key], single[key]):
            assert torch.equal(a, b)
            assert relative_error(a.float(), c.float()) < 2e-2


# --- distributed evaluation ---------------------------------------------------------------------
EVAL_N = 11


def eval_data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(EVAL_N, 6, generator=g), torch.randint(0, 3, (EVAL_N,), generator=g)


def eval_worker(local_rank):
    pt = paratrain.Parallel(strategy="ddp", global_batch=12, seed=2)
    model = pt.setup(tiny_model())
    loader = pt.eval_loader(TensorDataset(*eval_data()), batch_size=4)
    shard = len(loader.sampler)
    metrics = pt.evaluate(model, loader)
    state = {k: v.clone() for k, v in pt.unwrap(model).state_dict().items()}
    pt.close()
    return metrics, shard, state


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_evaluation_counts_each_sample_once(world, request):
    if world == 2:
        results = [r["eval"] for r in request.getfixturevalue("two_ranks")]
    else:
        results = paratrain.launch(eval_worker, nprocs=world, timeout=90)
    assert len(results) == world
    assert sum(shard for _, shard, _ in results) == EVAL_N
    metrics0, _, state = results[0]
    for metrics, _, other in results:
        assert metrics == metrics0  # every rank gets the reduced totals
        for k in state:
            assert torch.equal(other[k], state[k])
    assert metrics0["count"] == EVAL_N

    # the same model, one process, all 11 samples at once
    model = tiny_model()
    model.load_state_dict(state)
    x, y = eval_data()
    with torch.no_grad():
        out = model(x)
    accuracy = (out.argmax(1) == y).sum().item() / EVAL_N
    loss = nn.functional.cross_entropy(out, y).item()
    assert 0 < accuracy < 1  # a meaningful check, not all-right or all-wrong
    # accuracy is a count of argmax hits over 11: exact, only the division rounds (abs 1e-12)
    assert metrics0["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    # float32 loss of batches of 4, 4, 3 (summed in float64) vs one float32 mean of 11: no training,
    # nothing amplifies; measured 8e-8, so 1e-5 is >= 100x
    assert metrics0["loss"] == pytest.approx(loss, rel=1e-5)

    # and paratrain's own single-process evaluation agrees
    single = paratrain.Parallel(strategy="single", global_batch=12)
    ref = single.evaluate(single.setup(model), single.eval_loader(TensorDataset(x, y), batch_size=4))
    assert ref["count"] == EVAL_N
    assert ref["accuracy"] == pytest.approx(accuracy, abs=1e-12)  # as above
    assert ref["loss"] == pytest.approx(loss, rel=1e-5)


def _overflow_on_rank_1(local_rank):
    """A gradient sharded over 2 ranks (as fsdp/tensor hold it) whose inf is in rank 1's shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from paratrain.precision.amp import all_finite

    d = paratrain.init()
    mesh = init_device_mesh("cpu", (2,))
    full = torch.ones(4, 2)
    full[3, 0] = float("inf")  # rows 2-3 are rank 1's shard
    grad = distribute_tensor(full, mesh, [Shard(0)])
    plain = torch.ones(3)
    verdicts = (all_finite([plain, grad]), all_finite([plain, distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])]))
    dist.barrier()
    paratrain.destroy()
    return d.rank, verdicts


def test_a_static_scale_skips_an_overflow_on_every_rank_when_gradients_are_sharded():
    """fsdp/tensor: the rank whose shard held the inf once skipped the step alone."""
    assert paratrain.launch(_overflow_on_rank_1, 2, timeout=60) == [(0, (False, True)), (1, (False, True))]


def test_tensor_parallel_fp16_needs_a_static_loss_scale():
    from paratrain.config import ParallelConfig

    with pytest.raises(ValueError, match="fp16-mixed with the dynamic loss scale is not supported with strategy tensor"):
        ParallelConfig(strategy="tensor", precision="fp16-mixed")
    ParallelConfig(strategy="tensor", precision="fp16-mixed", loss_scale=128.0)
    with pytest.raises(ValueError, match="powersgd_start_iter 1 must be at least 2"):
        ParallelConfig(ddp={"comm_hook": "powersgd", "powersgd_start_iter": 1})


def _bf16_true_ddp_from_rank_dependent_init(local_rank):
    torch.manual_seed(100 + local_rank)  # each rank builds its own weights, before Parallel seeds them
    model = nn.Linear(4, 2)
    pt = paratrain.Parallel(strategy="ddp", precision="bf16-true", global_batch=8)
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    pt.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    state = {k: v.float().clone() for k, v in pt.unwrap(model).state_dict().items()}
    pt.close()
    return state


def test_master_weights_start_from_rank_0s_weights_under_ddp():
    """DDP broadcasts rank 0's weights into the model; the fp32 masters, made before, once kept each
    rank's own, and the first step copied them back: the replicas drifted apart."""
    a, b = paratrain.launch(_bf16_true_ddp_from_rank_dependent_init, 2, timeout=60)
    for k in a:
        assert torch.equal(a[k], b[k]), k
