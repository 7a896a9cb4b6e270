"""HuggingFace ``transformers`` models in your own loop (issue 10): a tiny GPT-2 causal LM and a
BERT classifier, from configs (no download), with dict batches and a scheduler, in bf16-mixed at
world sizes 1 and 2 under ddp and fsdp; and equal parameters at world sizes 1 and 2 (float64).

One launch at world size 2 runs every case (ddp and fsdp share its process group); world size 1
runs in the test process. ``transformers`` costs ~10 s to import on a busy 2-core machine.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import paratrain

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import hf_loop  # noqa: E402  (the example is what is tested)

pytestmark = pytest.mark.timeout(400)
STRATEGIES, KINDS, STEPS = ("ddp", "fsdp"), ("gpt2", "bert"), 6


def exact_run(strategy, kind):
    """float64, SGD with momentum and a linear schedule, the loss computed from the logits in
    float64 (HuggingFace computes its own loss in float32): a well-conditioned problem where world
    sizes 1 and 2 must agree to 1e-10."""
    pt = paratrain.Parallel(strategy=strategy, global_batch=8, seed=1, fsdp={"wrap_classes": [hf_loop.BLOCKS[kind]]})
    model = hf_loop.build_model(kind).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=STEPS)
    model, opt, sched = pt.setup(model, opt, sched)
    loader = pt.train_loader(hf_loop.TokenData(kind, 8 * STEPS))
    for batch in loader:
        labels = batch.pop("labels")
        logits = model(**batch).logits
        if kind == "gpt2":  # next-token prediction
            logits, labels = logits[:, :-1].reshape(-1, hf_loop.VOCAB), labels[:, 1:].reshape(-1)
        opt.zero_grad()
        pt.backward(nn.functional.cross_entropy(logits, labels))
        opt.step()
        sched.step()
    assert pt.global_step == STEPS and sched.last_epoch == STEPS
    return pt, pt.full_state_dict(model)


def hf_worker(rank, directory):
    report = {}
    for strategy in STRATEGIES:
        for kind in KINDS:
            pt = paratrain.Parallel(strategy=strategy, precision="bf16-mixed", global_batch=8,
                                    fsdp={"wrap_classes": [hf_loop.BLOCKS[kind]]})
            model, losses = hf_loop.train(pt, kind, steps=STEPS, n=8 * STEPS)
            evaluation = pt.evaluate(model, pt.eval_loader(hf_loop.TokenData(kind, 12, seed=1), batch_size=4))
            report[strategy, kind, "bf16"] = (losses, evaluation)
            saved = os.path.join(directory, f"{strategy}-{kind}-{pt.world_size}")
            pt.save_pretrained(model, saved)  # every rank calls it; the main process writes
            trained = pt.full_state_dict(model)
            if pt.is_main_process:  # what transformers loads back is the trained model
                loaded = type(pt.unwrap(model)).from_pretrained(saved).state_dict()
                report[strategy, kind, "saved"] = (sorted(loaded) == sorted(trained),
                                                   all(torch.equal(loaded[k], trained[k]) for k in trained))
            pt, report[strategy, kind, "f64"] = exact_run(strategy, kind)
    pt.close()
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pretrained"))
    world2 = paratrain.launch(hf_worker, nprocs=2, args=(directory,), timeout=360)
    world1 = hf_worker(0, directory)
    return world1, world2


def test_bf16_mixed_trains_at_world_sizes_1_and_2(reports):
    for report in (reports[0], *reports[1]):
        for strategy in STRATEGIES:
            for kind in KINDS:
                losses, evaluation = report[strategy, kind, "bf16"]
                assert len(losses) == STEPS and all(map(torch.isfinite, torch.tensor(losses)))
                assert sum(losses[-2:]) < sum(losses[:2]), (strategy, kind, losses)  # batches of 8: noisy per step
                assert evaluation["count"] == 12 and evaluation["loss"] > 0
                assert ("accuracy" in evaluation) == (kind == "bert")  # a language model's targets are not classes
    for report in (reports[0], reports[1][0]):  # the main processes: pt.save_pretrained wrote what was trained
        for strategy in STRATEGIES:
            for kind in KINDS:
                assert report[strategy, kind, "saved"] == (True, True), (strategy, kind)


def assert_close(got, ref, rtol):
    assert got.keys() == ref.keys()
    for k in ref:
        if ref[k].is_floating_point():
            diff, norm = (got[k] - ref[k]).norm().item(), ref[k].norm().item()
            if norm < 1e-9:
                # BERT's attention key bias starts at 0 and its gradient is 0 in exact arithmetic
                # (softmax ignores a shift shared by all keys): its value is rounding noise, so
                # only its absolute size is compared.
                assert diff <= 1e-12, f"{k}: absolute error {diff:.1e}"
            else:
                assert diff / norm <= rtol, f"{k}: relative error {diff / norm:.1e}"
        else:
            assert torch.equal(got[k], ref[k]), k


def test_equal_parameters_at_world_sizes_1_and_2(reports):
    world1, world2 = reports
    for kind in KINDS:
        ref = world1["ddp", kind, "f64"]
        assert_close(world1["fsdp", kind, "f64"], ref, 1e-10)
        for report in world2:
            for strategy in STRATEGIES:
                assert_close(report[strategy, kind, "f64"], ref, 1e-10)
