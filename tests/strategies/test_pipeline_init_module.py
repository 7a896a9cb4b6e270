"""A pipeline built under ``init_module`` (issue 35, item 3): each rank materialises only its own
stage, valued as a whole build would value it, and the other stages' blocks stay on the meta
device; trained in float64 through ``pt.train_loader`` and ``pt.training_step`` at world size 2,
it ends where the plain PyTorch loop in one process ends. Models as users build them: nanoGPT's
GPT, HuggingFace's GPT-2 (its ``lm_head`` tied to the token embedding, on the other stage) and
Llama (a rotary embedding every stage runs)."""

from __future__ import annotations

import pytest
import torch
import zoo
from parity import assert_same_state

import paratrain

pytestmark = pytest.mark.timeout(300)
GLOBAL_BATCH, STEPS, SEED, N = 8, 3, 7, 24


def _kinds() -> tuple[str, ...]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ("gpt",)
    return ("gpt", "gpt2", "llama")


def build(kind: str) -> torch.nn.Module:
    return (zoo.GPT() if kind == "gpt" else zoo.hf_model(kind)).double()


def train(kind: str) -> dict[str, object]:
    pt = paratrain.Parallel(strategy="pipeline", global_batch=GLOBAL_BATCH, seed=SEED)
    with pt.init_module():
        model = build(kind)
    built_on_meta = all(p.device.type == "meta" for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    original = model
    model, opt = pt.setup(model, opt)
    stage = {id(p) for p in pt.unwrap(model).parameters()}
    held = {n for n, p in original.named_parameters(remove_duplicate=False) if p.device.type != "meta"}
    others_meta = all(p.device.type == "meta" for p in original.parameters() if id(p) not in stage)
    for step, batch in enumerate(pt.train_loader(zoo.Tokens(N))):
        if step == STEPS:
            break
        opt.zero_grad()
        pt.training_step(model, batch, zoo.loss_of)
        opt.step()
    return {"meta": built_on_meta, "held": held, "others meta": others_meta, "state": pt.full_state_dict(model)}


def worker(rank: int, kinds: tuple[str, ...]) -> dict[str, dict[str, object]]:
    out = {kind: train(kind) for kind in kinds}
    paratrain.Parallel(strategy="pipeline").close()
    return out


@pytest.fixture(scope="module")
def world2():
    kinds = _kinds()
    return kinds, paratrain.launch(worker, nprocs=2, args=(kinds,), timeout=280)


def test_each_rank_materialises_its_own_stage_only(world2):
    kinds, ranks = world2
    for kind in kinds:
        names = [n for n, _ in build(kind).named_parameters(remove_duplicate=False)]
        held = [ranks[r][kind]["held"] for r in (0, 1)]
        for r in (0, 1):
            assert ranks[r][kind]["meta"] is True and ranks[r][kind]["others meta"] is True, (kind, r)
            assert 0 < len(held[r]) < len(names), (kind, r, sorted(held[r]))
        assert held[0] | held[1] == set(names), kind  # between them, the whole model


def test_trained_from_init_module_it_equals_one_process(world2):
    kinds, ranks = world2
    for kind in kinds:
        ref = zoo.train_plain(lambda kind=kind: build(kind), steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED,
                              data=zoo.Tokens(N))
        for r in (0, 1):
            got = ranks[r][kind]["state"]
            assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-9)
