"""Several optimizers in the user's own loop, against the same loop in plain PyTorch (float64)."""

import pytest
import torch
from torch import nn

import paratrain

N, B, SEED = 64, 16, 3


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    return x, x @ torch.randn(4, 2, generator=g, dtype=torch.float64)


def models():
    torch.manual_seed(SEED)
    return nn.Linear(4, 3).double(), nn.Linear(3, 2).double()


def plain_two_optimizers_one_backward(steps, clip=None):
    a, b = models()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.01)
    x, y = data()
    for step in range(steps):
        i = paratrain.data.epoch_permutation(N, SEED, step // (N // B))[(step % (N // B)) * B:][:B]
        loss = nn.functional.mse_loss(b(a(x[i])), y[i])
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([*a.parameters(), *b.parameters()], clip)
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    return [p.detach().clone() for p in (*a.parameters(), *b.parameters())]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_two_optimizers_after_one_backward_both_step(accumulation):
    """opt_a.step(); opt_b.step() after the same backward: the second once never stepped."""
    pt = paratrain.Parallel(global_batch=B, accumulation=accumulation, seed=SEED, clip_grad_norm=0.5)
    a, b = models()
    model, opt_a = pt.setup(nn.Sequential(a, b), torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9))
    opt_b = pt.setup_optimizer(torch.optim.Adam(b.parameters(), lr=0.01), model)
    loader = pt.train_loader(torch.utils.data.TensorDataset(*data()))
    for _ in range(2):
        for xb, yb in loader:
            pt.backward(nn.functional.mse_loss(model(xb), yb))
            opt_a.step()
            opt_b.step()
    assert pt.global_step == 2 * N // B
    got = [p.detach() for p in (*a.parameters(), *b.parameters())]
    for g, r in zip(got, plain_two_optimizers_one_backward(2 * N // B, clip=0.5)):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    pt.close()


def plain_gan(steps):
    d, g = models()
    opt_d = torch.optim.SGD(d.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(g.parameters(), lr=0.05)
    x, y = data()
    for step in range(steps):
        i = paratrain.data.epoch_permutation(N, SEED, step // (N // B))[(step % (N // B)) * B:][:B]
        opt_d.zero_grad()
        nn.functional.mse_loss(g(d(x[i])).detach(), y[i]).add(d(x[i]).pow(2).mean()).backward()
        opt_d.step()
        opt_g.zero_grad()
        nn.functional.mse_loss(g(d(x[i]).detach()), y[i]).backward()
        opt_g.step()
    return [p.detach().clone() for p in (*d.parameters(), *g.parameters())]


def test_a_gan_loop_counts_one_global_step_per_round():
    """Discriminator and generator each with a backward and an optimizer step of their own, per
    batch: one global step per batch (it once moved two, and the data position with it)."""
    pt = paratrain.Parallel(global_batch=B, seed=SEED)
    d, g = models()
    d_model, opt_d = pt.setup(d, torch.optim.SGD(d.parameters(), lr=0.05))
    g_model, opt_g = pt.setup(g, torch.optim.SGD(g.parameters(), lr=0.05))
    loader = pt.train_loader(torch.utils.data.TensorDataset(*data()))
    for xb, yb in loader:
        opt_d.zero_grad()
        pt.backward(nn.functional.mse_loss(g_model(d_model(xb)).detach(), yb).add(d_model(xb).pow(2).mean()))
        opt_d.step()
        opt_g.zero_grad()
        pt.backward(nn.functional.mse_loss(g_model(d_model(xb).detach()), yb))
        opt_g.step()
    assert pt.global_step == N // B and loader.epoch == 1
    got = [p.detach() for p in (*d.parameters(), *g.parameters())]
    for a, r in zip(got, plain_gan(N // B)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    pt.close()


def test_a_gan_loop_with_accumulation_is_refused_in_one_line():
    pt = paratrain.Parallel(global_batch=B, accumulation=2, seed=SEED)
    d, g = models()
    d_model, opt_d = pt.setup(d, torch.optim.SGD(d.parameters(), lr=0.05))
    g_model, opt_g = pt.setup(g, torch.optim.SGD(g.parameters(), lr=0.05))
    xb, yb = data()
    with pytest.raises(ValueError, match="two optimizers step after backward calls of their own .* accumulation 2"):
        for _ in range(2):
            pt.backward(d_model(xb[:8]).pow(2).mean())
            opt_d.step()
            pt.backward(nn.functional.mse_loss(g_model(d_model(xb[:8]).detach()), yb[:8]))
            opt_g.step()
    pt.close()


def test_two_optimizers_after_one_backward_under_fp16_are_refused():
    pt = paratrain.Parallel(global_batch=B, seed=SEED, precision="fp16-mixed")
    a, b = models()
    model, opt_a = pt.setup(nn.Sequential(a, b).float(), torch.optim.SGD(a.parameters(), lr=0.1))
    opt_b = pt.setup_optimizer(torch.optim.SGD(b.parameters(), lr=0.1))
    pt.backward(model(torch.randn(8, 4)).pow(2).mean())
    opt_a.step()
    with pytest.raises(ValueError, match="two optimizers stepping after one backward under precision fp16-mixed"):
        opt_b.step()
    pt.close()


def test_reduce_lr_on_plateau_cannot_be_registered():
    pt = paratrain.Parallel(global_batch=B)
    model, opt = pt.setup(net := nn.Linear(2, 2), torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="ReduceLROnPlateau steps on a metric .* call scheduler.step.metric. yourself"):
        pt.register_scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    pt.close()
