"""Your own loop under ``Parallel``: model outputs of any type, schedulers, dict batches, your own
DataLoader, metrics — the things an Accelerate or Fabric user's loop does (issue 10)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

import paratrain

Pair = namedtuple("Pair", ["logits", "hidden"])


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor
    name: str = "out"


class AttrDict(OrderedDict):
    """What HuggingFace's ``ModelOutput`` is: an OrderedDict whose keys are also attributes."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


class AnyOutput(nn.Module):
    """A linear model that returns its output in the container ``kind`` names."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.lin(x)
        loss = logits.float().logsumexp(1).mean()  # any scalar that depends on the weights
        ids = torch.arange(len(x))
        if self.kind == "tensor":
            return logits
        if self.kind == "tuple":
            return logits, ids, "tag"
        if self.kind == "list":
            return [logits, ids]
        if self.kind == "dict":
            return {"loss": loss, "logits": logits, "ids": ids, "note": "kept"}
        if self.kind == "ordered":
            return OrderedDict(loss=loss, logits=logits)
        if self.kind == "attrdict":
            out = AttrDict()
            out["loss"], out["logits"] = loss, logits
            return out
        if self.kind == "dataclass":
            return Output(loss, logits)
        if self.kind == "namedtuple":
            return Pair(logits, (logits, ids))
        raise ValueError(self.kind)


KINDS = ["tensor", "tuple", "list", "dict", "ordered", "attrdict", "dataclass", "namedtuple"]


def _collect(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, dict):
        obj = list(obj.values())
    return [t for o in obj for t in _collect(o)] if isinstance(obj, (list, tuple)) else []


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "fp16-mixed", "bf16-true"])
def test_outputs_keep_their_type(precision):
    """Every container comes back as the same type; floating tensors in fp32 under autocast;
    integers, strings and attributes untouched; backward works through ``out.loss``."""
    pt = paratrain.Parallel(precision=precision, global_batch=4)
    for kind in KINDS:
        model = AnyOutput(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = pt.setup(model, opt)
        out = model(torch.randn(4, 4))
        assert type(out) is {"tensor": torch.Tensor, "tuple": tuple, "list": list, "dict": dict,
                             "ordered": OrderedDict, "attrdict": AttrDict, "dataclass": Output,
                             "namedtuple": Pair}[kind], kind
        for t in _collect(out):
            assert t.dtype in (torch.float32, torch.int64), (kind, t.dtype)
        if kind == "tuple":
            assert out[2] == "tag" and out[1].dtype == torch.int64
        if kind == "dict":
            assert out["note"] == "kept" and torch.equal(out["ids"], torch.arange(4))
        if kind == "namedtuple":
            assert isinstance(out.hidden, tuple) and out.hidden[1].dtype == torch.int64
        if kind == "dataclass":
            assert out.name == "out"
        if kind in ("attrdict", "dataclass"):
            before = model.lin.weight.detach().clone()
            opt.zero_grad()
            pt.backward(out.loss)
            opt.step()
            assert not torch.equal(before, model.lin.weight.detach()), kind
    pt.close()


def test_huggingface_model_output_keeps_its_type():
    """A real ``transformers`` ``ModelOutput`` (OrderedDict + dataclass) survives bf16-mixed."""
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")

    class HF(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            logits = self.lin(x)
            return modeling_outputs.SequenceClassifierOutput(loss=logits.logsumexp(1).mean(), logits=logits)

    pt = paratrain.Parallel(precision="bf16-mixed", global_batch=4)
    model = pt.setup(HF())
    out = model(torch.randn(4, 4))
    assert type(out) is modeling_outputs.SequenceClassifierOutput
    assert out.logits.dtype == torch.float32 and out["logits"] is out.logits and out.loss.dtype == torch.float32
    assert out.hidden_states is None and list(out.keys()) == ["loss", "logits"]
    pt.backward(out.loss)
    assert model.lin.weight.grad is not None
    pt.close()


# --- schedulers ---------------------------------------------------------------------------------
N, B, SEED = 48, 8, 5  # 6 optimizer steps per epoch


def regression_data(dtype=torch.float64):
    """Learnable (a noisy linear map): a well-conditioned problem for exact comparisons."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g, dtype=dtype)
    y = x @ torch.randn(4, 2, generator=g, dtype=dtype) + 0.01 * torch.randn(N, 2, generator=g, dtype=dtype)
    return x, y


def make_scheduler(opt):
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
    decay = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[3])


def reference_run(epochs):
    """Plain PyTorch: one optimizer step and one scheduler step per global batch of B samples."""
    x, y = regression_data()
    torch.manual_seed(SEED)
    model = nn.Linear(4, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = make_scheduler(opt)
    lrs = []
    for epoch in range(epochs):
        perm = paratrain.data.epoch_permutation(N, SEED, epoch)
        for s in range(N // B):
            i = perm[s * B:(s + 1) * B]
            opt.zero_grad()
            nn.functional.mse_loss(model(x[i]), y[i]).backward()
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    return model.state_dict(), lrs


def paratrain_run(pattern, epochs, accumulation=2, checkpoint=None, resume=None):
    pt = paratrain.Parallel(global_batch=B, accumulation=accumulation, seed=SEED)
    torch.manual_seed(SEED)
    model = nn.Linear(4, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if pattern == "setup":  # built on the user's optimizer, handed to setup, stepped by the user
        model, opt, sched = pt.setup(model, opt, make_scheduler(opt))
    else:  # built on the optimizer setup returns
        model, opt = pt.setup(model, opt)
        sched = make_scheduler(opt)
        if pattern == "register":
            pt.register_scheduler(sched)
    if resume:
        pt.load_checkpoint(resume, model, opt)
    loader = pt.train_loader(torch.utils.data.TensorDataset(*regression_data()))
    lrs = []
    while pt.global_step < epochs * (N // B):
        for xb, yb in loader:
            opt.zero_grad()
            pt.backward(nn.functional.mse_loss(model(xb), yb))
            opt.step()
            if pattern != "register":
                sched.step()  # after every optimizer.step(): once per micro-batch
            if pt.micro_step == 0:
                lrs.append(opt.param_groups[0]["lr"])
                if checkpoint and pt.global_step == checkpoint[1]:
                    pt.save_checkpoint(checkpoint[0], model, opt)
    state = {k: v.clone() for k, v in pt.unwrap(model).state_dict().items()}
    pt.close()
    return state, lrs, sched


def assert_states_equal(got, ref, rtol):
    assert got.keys() == ref.keys()
    for k in ref:
        err = ((got[k] - ref[k]).norm() / ref[k].norm()).item()
        assert err <= rtol, f"{k}: relative error {err:.1e}"


def test_scheduler_accepts_setup_optimizer_without_warnings():
    pt = paratrain.Parallel(global_batch=4)
    model, opt = pt.setup(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1))
    assert isinstance(opt, torch.optim.Optimizer)
    for build in (lambda o: torch.optim.lr_scheduler.StepLR(o, 2), lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, 10),
                  lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10), make_scheduler,
                  lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o)):
        build(opt)
    pt.close()


@pytest.mark.parametrize("pattern", ["setup", "register"])
def test_scheduler_steps_once_per_optimizer_step(pattern, recwarn):
    """accumulation=2, world size 1: the scheduler follows the optimizer steps, not the micro-batches,
    and the run equals plain PyTorch (float64: 1e-10), with no ordering warning."""
    ref, ref_lrs = reference_run(epochs=2)
    got, lrs, sched = paratrain_run(pattern, epochs=2)
    assert lrs == pytest.approx(ref_lrs, rel=1e-12)
    assert sched.last_epoch == 12
    assert_states_equal(got, ref, 1e-10)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message) or "learning rate" in str(w.message)]


def test_scheduler_stepped_per_micro_batch_is_reported():
    """A scheduler paratrain does not know about, stepped after every optimizer.step() under
    accumulation, moves the lr mid-batch: one warning says how to fix it."""
    with pytest.warns(UserWarning, match="changed in the middle of an accumulation"):
        paratrain_run("user", epochs=1)


@pytest.mark.parametrize("pattern", ["setup", "register"])
def test_scheduler_state_resumes_exactly(pattern, tmp_path):
    ref, ref_lrs = reference_run(epochs=2)
    paratrain_run(pattern, epochs=1, checkpoint=(tmp_path, 5))  # saved at step 5, mid-epoch
    got, lrs, sched = paratrain_run(pattern, epochs=2, resume=tmp_path)
    assert lrs == pytest.approx(ref_lrs[5:], rel=1e-12)
    assert sched.last_epoch == 12
    assert_states_equal(got, ref, 1e-10)
