"""pipeline on models as users build them (issue 28, item 0): a nanoGPT-style GPT, HuggingFace's
GPT-2 (its ``lm_head`` tied to the token embedding, on the other stage) and Llama, and a BERT
classifier, cut between their blocks at world size 2, each in float64 against the plain PyTorch
loop in one process; the GPT-2 pipeline's checkpoint loads into a one-process run."""

from __future__ import annotations

import pytest
import torch
import zoo
from parity import assert_same_state

import paratrain
from paratrain.strategies._stack import split_stack

pytestmark = pytest.mark.timeout(300)
GLOBAL_BATCH, STEPS, SEED, N = 8, 3, 7, 24
KINDS = ("gpt", "gpt2", "llama", "bert")
LOOPED = ("interleaved1f1b", "interleavedzerobubble", "zbvzerobubble", "dualpipev")  # two stages a rank: a 4-block
# GPT cut into 4 stages; the last two place them in a V (rank 0: stages 0 and 3, rank 1: stages 1 and 2)


def build(kind: str) -> torch.nn.Module:
    return zoo.GPT() if kind == "gpt" else zoo.GPT(n_layer=4) if kind == "gpt4" else zoo.hf_model(kind)


def data(kind: str) -> zoo.Tokens:
    return zoo.Tokens(N, classes=2 if kind == "bert" else None)


def train_pipeline(kind: str, folder: str | None = None, schedule: str = "gpipe") -> dict[str, torch.Tensor]:
    pt = paratrain.Parallel(strategy="pipeline", global_batch=GLOBAL_BATCH, seed=SEED, pipeline={"schedule": schedule})
    model = build(kind).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt = pt.setup(model, opt)
    for step, batch in enumerate(pt.train_loader(data(kind))):
        if step == STEPS:
            break
        opt.zero_grad()
        pt.training_step(model, batch, zoo.loss_of)
        opt.step()
    if folder:
        pt.save_checkpoint(folder, model, opt)
    if schedule in LOOPED:  # this rank's stages, in one module under the model's own keys
        return {**pt.full_state_dict(model), "held": sorted(pt.strategy.unwrap(model).state_dict())}
    return pt.full_state_dict(model)


def worker(rank: int, folder: str) -> dict[str, dict[str, torch.Tensor]]:
    out = {kind: train_pipeline(kind, folder if kind == "gpt2" else None) for kind in KINDS}
    out.update({schedule: train_pipeline("gpt4", schedule=schedule) for schedule in LOOPED})
    paratrain.Parallel(strategy="pipeline").close()
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("pipeline") / "checkpoints"
    rank0, rank1 = paratrain.launch(worker, nprocs=2, args=(str(folder),), timeout=280)
    return rank0, rank1, folder


@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_equals_one_process(world2, kind):
    ref = zoo.train_plain(lambda: build(kind), steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED, data=data(kind))
    for rank in (0, 1):
        got = world2[rank][kind]
        assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-9)


@pytest.mark.parametrize("schedule", LOOPED)
def test_two_stages_a_rank_equal_one_process(world2, schedule):
    """Issue 35: the schedules of 2 stages a rank train what one process trains, the tied embedding (stage 0) and head
    (stage 3) included; so they equal GPipe. The interleaved ones loop (rank 0 runs stages 0 and 2, rank 1 stages 1
    and 3); ZBV and DualPipeV place them in a V (rank 0: stages 0 and 3, so both tied weights; rank 1: 1 and 2)."""
    ref = zoo.train_plain(lambda: build("gpt4"), steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED, data=data("gpt"))
    for rank in (0, 1):
        got = world2[rank][schedule]
        assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-9)
    blocks = [{k.split(".")[2] for k in world2[rank][schedule]["held"] if k.startswith("transformer.h.")}
              for rank in (0, 1)]
    v = schedule in ("zbvzerobubble", "dualpipev")
    assert blocks == ([{"0", "3"}, {"1", "2"}] if v else [{"0", "2"}, {"1", "3"}])
    assert "transformer.wte.weight" in world2[0][schedule]["held"]
    assert "lm_head.weight" in world2[0 if v else 1][schedule]["held"]


def test_tied_weights_step_alike_on_both_stages(world2):
    state = world2[0]["gpt2"]
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


def test_a_pipeline_checkpoint_loads_into_one_process(world2):
    rank0, _, folder = world2
    pt = paratrain.Parallel(global_batch=GLOBAL_BATCH, seed=SEED)
    model = zoo.hf_model("gpt2").double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt = pt.setup(model, opt)
    pt.load_checkpoint(str(folder), model, opt)
    assert pt.global_step == STEPS
    got = pt.full_state_dict(model)
    assert all(torch.equal(got[k], v) for k, v in rank0["gpt2"].items())
    pt.close()


def test_stages_own_their_blocks_and_the_ends():
    pytest.importorskip("transformers")
    first, last = split_stack(zoo.hf_model("llama"), 2, 0, distributed=False)
    assert {k.split(".")[1] for k in first.state_dict()} == {"embed_tokens", "layers"}
    assert {k.rsplit(".", 1)[0] for k in last.state_dict() if not k.startswith("model.layers")} == {"model.norm", "lm_head"}
    assert not set(first.state_dict()) & set(last.state_dict())
    with pytest.raises(ValueError, match="give 1 of the blocks"):
        split_stack(zoo.GPT(), 2, 0, ["transformer.h.0"], distributed=False)
