"""tensor and pipeline on models as users build them (issue 28, item 0): a HuggingFace Llama through its own
plan (``base_model_tp_plan``), nanoGPT's GPT with its fused ``c_attn`` through the automatic plan,
and a user's plan with ``*`` patterns, each at world size 2 in float64 against plain PyTorch in one
process; a HuggingFace model without a plan is refused in one line, and the cut at top-level children
refuses a decoder in one line (pipeline then cuts it between its blocks: test_pipeline_models.py)."""

from __future__ import annotations

import pytest
import torch
import zoo
from parity import assert_same_state
from torch import nn

import paratrain
from paratrain.strategies.tensor import auto_plan, expand_plan, model_plan

pytestmark = pytest.mark.timeout(300)
GLOBAL_BATCH, STEPS, SEED, N = 8, 3, 5, 24
USER_PLAN = {"blocks.*.1.c_fc": "colwise", "blocks.*.1.c_proj": "rowwise"}


def build(kind: str) -> nn.Module:
    return zoo.GPT() if kind == "gpt" else zoo.BlockNet() if kind == "blocknet" else zoo.hf_model(kind)


def train_tensor(kind: str, plan: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    return zoo.train_parallel(lambda: build(kind), "tensor", steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED,
                              data=zoo.Tokens(N), tensor={"plan": plan or {}})


def worker(rank: int, cases: list[tuple[str, dict[str, str] | None]]) -> dict[str, dict[str, torch.Tensor]]:
    out = {kind + ("+plan" if plan else ""): train_tensor(kind, plan) for kind, plan in cases}
    try:
        train_tensor("bert")
        out["bert"] = "trained"  # type: ignore[assignment]
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        out["bert"] = f"{type(e).__name__}: {e}"  # type: ignore[assignment]
    paratrain.Parallel(strategy="tensor").close()
    return out


def reference(kind: str) -> dict[str, torch.Tensor]:
    return zoo.train_plain(lambda: build(kind), steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED, data=zoo.Tokens(N))


@pytest.fixture(scope="module")
def world2():
    pytest.importorskip("transformers")
    cases = [("llama", None), ("gpt", None), ("blocknet", USER_PLAN)]
    rank0, _ = paratrain.launch(worker, nprocs=2, args=(cases,), timeout=240)
    return rank0


@pytest.mark.parametrize("case", ["llama", "gpt", "blocknet+plan"])
def test_tensor_equals_one_process(world2, case):
    ref = reference(case.split("+")[0])
    got = world2[case]
    assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-9)


def test_a_huggingface_model_without_a_plan_is_refused_in_one_line(world2):
    line = world2["bert"]
    assert "\n" not in line and "cannot split BertForSequenceClassification's" in line and "tensor={'plan'" in line


def test_plans_the_strategy_would_use():
    pytest.importorskip("transformers")
    llama = zoo.hf_model("llama")
    plan = expand_plan(llama, model_plan(llama))
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise" and plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert model_plan(zoo.GPT()) is None
    gpt = auto_plan(zoo.GPT())
    # the fused qkv projection gathers its output whole: the forward splits it into q, k, v
    assert gpt["transformer.h.0.attn.c_attn"] == "colwise_rep" and gpt["transformer.h.0.attn.c_proj"] == "rowwise_rep"
    assert gpt["transformer.h.0.mlp.c_fc"] == "colwise" and gpt["transformer.h.0.mlp.c_proj"] == "rowwise"
    assert expand_plan(zoo.BlockNet(), USER_PLAN) == {f"blocks.{i}.1.{n}": s for i in range(3)
                                                      for n, s in (("c_fc", "colwise"), ("c_proj", "rowwise"))}


@pytest.mark.parametrize("kind", ["llama", "gpt", "blocknet"])
def test_pipeline_refuses_a_decoder_it_cannot_cut_in_one_line(kind):
    if kind == "llama":
        pytest.importorskip("transformers")
    from paratrain.strategies._split import split_model
    from paratrain.strategies.base import NotApplicable

    with pytest.raises(NotApplicable) as e:
        split_model(build(kind), 2)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"pipeline: cannot cut {type(build(kind)).__name__} into stages")
    assert "nn.Sequential" in line


class Encoder(nn.Module):
    """A model with a method besides forward that uses the root's own parameters directly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(zoo.VOCAB, zoo.WIDTH)
        self.blocks = nn.ModuleList([nn.Linear(zoo.WIDTH, zoo.WIDTH) for _ in range(2)])
        self.head = nn.Linear(zoo.WIDTH, zoo.VOCAB)

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(ids))


def generate_worker(rank: int) -> dict[str, object]:
    out: dict[str, object] = {}
    prompt = torch.tensor([[1, 2, 3]])
    for strategy in ("fsdp", "tensor"):
        pt = paratrain.Parallel(strategy=strategy, seed=SEED)
        model = pt.setup(zoo.hf_model("llama"))
        out[strategy] = model.generate(prompt, max_new_tokens=5, do_sample=False).tolist()
    pt = paratrain.Parallel(strategy="fsdp", seed=SEED)
    model = pt.setup(Encoder())
    pt.mark_forward_method(model, "encode")
    out["encode"] = model.encode(torch.tensor([[4, 5]])).detach()
    pt.close()
    return out


def test_generate_and_marked_methods_at_world_size_2_equal_one_process():
    pytest.importorskip("transformers")
    ranks = paratrain.launch(generate_worker, nprocs=2, timeout=240)
    torch.manual_seed(SEED)
    want = zoo.hf_model("llama").generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False).tolist()
    torch.manual_seed(SEED)
    encoded = Encoder().encode(torch.tensor([[4, 5]])).detach()
    for got in ranks:
        assert got["fsdp"] == want and got["tensor"] == want
        torch.testing.assert_close(got["encode"], encoded, rtol=1e-6, atol=1e-6)


def test_mark_forward_method_names_a_missing_method():
    pt = paratrain.Parallel(strategy="single")
    model = pt.setup(Encoder())
    with pytest.raises(ValueError, match="Encoder has no method 'decode'"):
        pt.mark_forward_method(model, "decode")
    with pytest.raises(ValueError, match="takes the model pt.setup returned"):
        pt.mark_forward_method(Encoder(), "encode")
