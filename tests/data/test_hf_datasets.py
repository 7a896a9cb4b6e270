"""HuggingFace ``datasets`` in a user's own loop: a ``Dataset`` (``with_format("torch")``, rows as
dicts) trains through ``pt.train_loader`` to the same weights as the same rows in a plain
``TensorDataset``, at world sizes 1 and 2 (float64, a plain loop written here); ``pt.evaluate``
takes the ``Dataset`` itself; a streamed ``IterableDataset`` gives global batches; a dict batch for
a model that takes no keywords is one line naming ``step_fn``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain

hf = pytest.importorskip("datasets")
pytestmark = pytest.mark.timeout(120)

N, BATCH, STEPS, SEED = 64, 8, 6, 5


def rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    return x, (x @ torch.randn(4, 3, generator=g, dtype=torch.float64)).argmax(1)


def hf_rows():
    x, y = rows()
    return hf.Dataset.from_dict({"x": x.tolist(), "label": y.tolist()}).with_format("torch", dtype=torch.float64)


def train(kind: str) -> dict[str, torch.Tensor]:
    """``STEPS`` steps of a linear classifier on the rows, as an HF Dataset or a TensorDataset."""
    pt = paratrain.Parallel(strategy="ddp", global_batch=BATCH, seed=SEED)
    torch.manual_seed(SEED)
    model = nn.Linear(4, 3).double()
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    data = hf_rows() if kind == "hf" else torch.utils.data.TensorDataset(*rows())
    for batch in pt.train_loader(data):
        if pt.global_step == STEPS:
            break
        x, y = (batch["x"], batch["label"].long()) if kind == "hf" else batch
        pt.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    state = pt.full_state_dict(model)
    pt.close()
    return state


def _both(rank: int) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: train(kind) for kind in ("hf", "tensors")}


def test_an_hf_dataset_trains_as_the_same_rows_in_a_tensordataset_at_world_sizes_1_and_2() -> None:
    one = _both(0)
    for kind in ("hf", "tensors"):
        assert one[kind].keys() == {"weight", "bias"}
    assert all(torch.equal(one["hf"][k], one["tensors"][k]) for k in one["hf"])
    two = paratrain.launch(_both, nprocs=2, timeout=90)
    for rank_states in two:
        for kind in ("hf", "tensors"):
            assert all(torch.allclose(rank_states[kind][k], one["hf"][k], rtol=1e-10, atol=0) for k in one["hf"])


def test_evaluate_takes_an_hf_dataset_and_says_how_to_read_its_dict_batches() -> None:
    pt = paratrain.Parallel(global_batch=BATCH, seed=SEED)
    model = pt.setup(nn.Linear(4, 3).double())
    data = hf_rows()
    with pytest.raises(TypeError, match=r"a dict batch \('x', 'label'\) is passed as model\(\*\*batch\).*step_fn="):
        pt.evaluate(model, data)
    got = pt.evaluate(model, data, step_fn=lambda m, b: (m(b["x"]), b["label"].long()))
    x, y = rows()
    with torch.no_grad():
        want = nn.functional.cross_entropy(pt.unwrap(model)(x), y).item()
    assert got["count"] == N and got["loss"] == pytest.approx(want, rel=1e-12)
    pt.close()


def test_a_streamed_hf_dataset_gives_global_batches() -> None:
    pt = paratrain.Parallel(global_batch=BATCH, seed=SEED)
    x, y = rows()
    stream = hf.Dataset.from_dict({"x": x.tolist(), "label": y.tolist()}).to_iterable_dataset().with_format("torch")
    batches = []
    for batch in pt.train_loader(stream):
        batches.append(batch)
        if len(batches) == 3:
            break
    assert [tuple(b["x"].shape) for b in batches] == [(BATCH, 4)] * 3
    pt.close()
