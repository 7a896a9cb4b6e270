"""devices: parts of one model on several devices of one process (seed 004) == the plain model."""

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.config import ParallelConfig
from paratrain.env.base import ProcessInfo
from paratrain.env.process import Dist
from paratrain.models import MLP
from paratrain.strategies.devices import DevicesStrategy, DeviceSplit, DevicesOptions, default_devices
from parity import Problem, assert_same_state, mlp, teacher_data

make_model = functools.partial(mlp, 12, 16, 16, 4)
# 6 optimizer steps. The devices run the plain model's own operations in one process, so they
# match to rounding (measured 0); 1e-5 is the parity float32 tolerance, and the reference's
# 1 vs 2 threads and float32 vs float64 gaps (tests/test_parity_conditioning.py) are <= 2e-7.
PROBLEM = Problem(make_model, functools.partial(teacher_data, 96, (12,), seed=321), global_batch=16, steps=6, seed=4,
                  lr=0.05, momentum=0.9, rtol=1e-5)
PROBLEMS = {"mlp": PROBLEM}


def devices_worker(local_rank):
    p = PROBLEM
    pt = paratrain.Parallel(strategy="devices", global_batch=p.global_batch, seed=p.seed,
                            devices={"devices": ["cpu", "cpu", "cpu"], "split_points": ["2", "4"]})
    model = p.model()
    opt = p.optimizer(model.parameters())
    model, opt = pt.setup(model, opt)
    split = model.module
    assert isinstance(split, DeviceSplit) and len(split.parts) == 3
    assert [list(part._modules) for part in split.parts] == [["0", "1"], ["2", "3"], ["4"]]
    for xb, yb in pt.train_loader(TensorDataset(*p.data())):  # one epoch = p.steps
        opt.zero_grad()
        loss = pt.training_step(model, (xb, yb), nn.functional.cross_entropy)
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pt.close()
    return state, loss.item()


def test_devices_matches_single_process_reference():
    ref = PROBLEM.reference()
    ((state, loss),) = paratrain.launch(devices_worker, nprocs=1, timeout=60)
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
