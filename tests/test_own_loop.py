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
