"""devices: parts of one model on several devices of one process (seed 004) == the plain model."""

import functools

import pytest
import torch
from torch import nn

from paratrain.config import ParallelConfig
from paratrain.env.base import ProcessInfo
from paratrain.env.process import Dist
from paratrain.models import MLP
from paratrain.strategies.devices import DevicesStrategy, DeviceSplit, DevicesOptions, default_devices
from parity import Problem, assert_same_state, mlp, run_workers, teacher_data

make_model = functools.partial(mlp, 12, 16, 16, 4)
# 6 optimizer steps. The devices run the plain model's own operations in one process, so they
# match to rounding (measured 0); 1e-5 is the parity float32 tolerance, and the reference's
# 1 vs 2 threads and float32 vs float64 gaps (tests/test_parity_conditioning.py) are <= 2e-7.
PROBLEM = Problem(make_model, functools.partial(teacher_data, 96, (12,), seed=321), global_batch=16, steps=6, seed=4,
                  lr=0.05, momentum=0.9, rtol=1e-5)
PROBLEMS = {"mlp": PROBLEM}


def split_in_three(pt, model, opt):
    split = model._forward_module
    assert model.module is pt.unwrap(model)  # .module is the user's model, as at world size 1
    assert isinstance(split, DeviceSplit) and len(split.parts) == 3
    assert [list(part._modules) for part in split.parts] == [["0", "1"], ["2", "3"], ["4"]]


def test_devices_matches_single_process_reference():
    ref = PROBLEM.reference()
    options = {"devices": {"devices": ["cpu", "cpu", "cpu"], "split_points": ["2", "4"]}, "before": split_in_three}
    ((run,),) = run_workers(1, (PROBLEM, "devices", options), timeout=60)
    state = run["state"]
    assert_same_state(state, ref.state, PROBLEM.rtol)  # the user's own keys, the reference's values


def strategy(**options):
    return DevicesStrategy(Dist(ProcessInfo(), torch.device("cpu"), None), options=DevicesOptions(**options))


def test_forward_moves_activations_into_each_part(monkeypatch):
    assert default_devices(torch.device("cpu")) == ["cpu", "cpu"]
    model = make_model()
    split = strategy().setup_model(model)  # default: two CPU parts, balanced by parameters
    assert [list(p._modules) for p in split.parts] == [["0", "1"], ["2", "3", "4"]]
    assert split.devices == [torch.device("cpu")] * 2 and split.output_device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())

    calls, moves = [], []
    for i, part in enumerate(split.parts):
        part.register_forward_pre_hook(lambda m, args, i=i: calls.append((i, args[0].device)))
    to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        moves.append(args[0] if args else kwargs.get("device"))
        return to(self, *args, **kwargs)

    x = torch.randn(5, 12)
    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    out = split(x)
    monkeypatch.undo()
    assert calls == [(0, torch.device("cpu")), (1, torch.device("cpu"))]  # each part once, in order
    assert moves == [torch.device("cpu")] * 3  # into part 1, into part 2, out to the process device
    assert torch.equal(out, model(x))


def test_bad_options():
    with pytest.raises(ValueError, match=r"3 parts \(devices\) but Sequential has only 2 top-level layers \(0, 1\): use fewer devices"):
        strategy(devices=["cpu"] * 3).setup_model(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(ValueError, match="devices: split point 'fc9' is not a top-level child of MLP"):
        strategy(split_points=["fc9"]).setup_model(MLP(12, 8, 4))
    with pytest.raises(ValueError, match="'gpu0' is not a device"):
        DevicesOptions(devices=["gpu0"])
    assert DevicesOptions(devices="cpu,cpu").devices == ["cpu", "cpu"]  # from the command line
    with pytest.raises(ValueError, match="MLP.forward is not its top-level children called in order"):
        strategy().setup_model(MLP(12, 8, 4, log_softmax=True))(torch.randn(2, 1, 3, 4))  # log_softmax outside the children
    with pytest.raises(ValueError, match="runs in one process, but 2 were asked for"):
        DevicesStrategy(Dist(ProcessInfo(rank=0, world_size=2), torch.device("cpu"), "gloo"))
    assert ParallelConfig(strategy="devices", devices={"devices": ["cpu", "cpu"]}).devices.devices == ["cpu", "cpu"]


# --- micro-batch pipelining (GPipe in one process) ---------------------------------------------

from paratrain.strategies.devices import _clock  # noqa: E402

N, GLOBAL_BATCH, SEED, LR = 96, 16, 4, 0.05  # the float64 micro-batch cases: 6 steps of PROBLEM's data


def make_data():
    return teacher_data(N, (12,), seed=321)


def make_model64():
    torch.manual_seed(SEED)
    # In-place ReLUs at the cuts: a part's first layer gets a tensor it may overwrite, as unpipelined.
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True),
                         nn.Linear(16, 4)).double()


def train64(model, steps=6):
    """A plain PyTorch loop in float64 (the reference when ``model`` is the plain model)."""
    x, y = make_data()
    x = x.double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED))
    for s in range(steps):
        i = perm[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[i]), y[i]).backward()
        opt.step()


def test_clock_ticks_are_gpipes():
    assert _clock(2, 4) == [[(0, 0)], [(0, 1), (1, 0)], [(0, 2), (1, 1)], [(0, 3), (1, 2)], [(1, 3)]]
    assert _clock(2, 3, reverse=True) == [[(1, 0)], [(1, 1), (0, 0)], [(1, 2), (0, 1)], [(0, 2)]]
    assert sum(len(t) for t in _clock(3, 5)) == 15 and len(_clock(3, 5)) == 7


@pytest.mark.parametrize("micro_batches", [4, 3, 32])  # even chunks, uneven (6, 5, 5), more than the batch
def test_micro_batches_train_like_a_plain_loop(micro_batches):
    plain = make_model64()
    train64(plain)
    states = {}
    # micro_batches=1 (the parts one after another), k pipelined forward and backward, and k with
    # the backward left to the autograd engine (what CUDA parts get)
    for k, pipelined_backward in ((1, True), (micro_batches, True), (micro_batches, False)):
        model = make_model64()
        split = strategy(devices=["cpu"] * 3, split_points=["1", "3"], micro_batches=k).setup_model(model)
        split.pipelined_backward = pipelined_backward
        assert split.micro_batches == k
        train64(split)
        states[(k, pipelined_backward)] = model.state_dict()
    for key, ref in plain.state_dict().items():
        for k, state in states.items():
            err = ((state[key] - ref).norm() / ref.norm()).item()
            assert err <= 1e-10, f"micro_batches, pipelined backward = {k}, {key}: relative error {err:.2e}"


def test_micro_batches_input_gradient_eval_and_single_backward():
    model = make_model64()
    split = strategy(micro_batches=4).setup_model(model)
    x = torch.randn(10, 12, dtype=torch.float64, requires_grad=True)
    out = split(x)
    assert type(out.grad_fn).__name__ == "_PipelinedPartsBackward"  # CPU parts: the pipelined backward
    out.pow(2).sum().backward(retain_graph=True)
    grads = [p.grad.clone() for p in split.parameters()]
    x_ref = x.detach().clone().requires_grad_()
    model.zero_grad()
    model(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-14)
    for g, p in zip(grads, split.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-14)
    with pytest.raises(RuntimeError, match="backward through one pipelined forward runs once"):
        out.sum().backward()
    with torch.no_grad():  # evaluation: pipelined forward, no autograd function
        torch.testing.assert_close(split(x), model(x), rtol=1e-12, atol=1e-14)
    frozen = strategy(micro_batches=4).setup_model(make_model64().requires_grad_(False))
    assert frozen(x.detach()).grad_fn is None  # nothing to differentiate: a plain pipelined forward


def test_micro_batches_options_and_warnings():
    for bad in (0, -2, "4", True):
        with pytest.raises(ValueError, match="micro_batches .* must be an integer of at least 1"):
            DevicesOptions(micro_batches=bad)
    assert ParallelConfig(strategy="devices", devices={"micro_batches": "4"}).devices.micro_batches == 4  # --set
    bn = nn.Sequential(nn.Linear(12, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Linear(8, 4))
    with pytest.warns(UserWarning) as caught:
        strategy(micro_batches=2).setup_model(bn)
    said = " | ".join(str(w.message) for w in caught)
    assert "BatchNorm normalises each micro-batch on its own" in said and "dropout masks depend on" not in said
    assert "draw their dropout masks from one generator in several threads" in said
