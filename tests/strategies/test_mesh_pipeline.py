"""Pipelines side by side (issue 35): ``pp x dp_shard`` and ``pp x dp_replicate`` at world size 4,
through ``pt.train_loader`` and ``pt.training_step``, in float64 against plain PyTorch in one process,
on a tiny HuggingFace Llama (untied, with gradient clipping: one norm over every stage and shard) and
nanoGPT's GPT (tied embeddings on the first and last stages), two of the layouts built under
``init_module`` (each rank materialises only its stage's part); a checkpoint of ``pp2 x dp_shard2``
resumed under ``dp_shard=4``; and one run handed from layout to layout through its checkpoints, one
step in each: one process -> the 3-D ``pp2 x dp_shard2 x tp2`` -> ``dp_shard=4`` -> ``pp2 x tp2`` -> one
process."""

from __future__ import annotations

import contextlib

import pytest
import torch
import zoo
from parity import assert_same_state

import paratrain

pytestmark = pytest.mark.timeout(300)
GLOBAL_BATCH, STEPS, SEED, N = 8, 3, 5, 24
LAYOUTS = {"pp2_dp_shard2": {"pp": 2, "dp_shard": 2}, "pp2_dp_replicate2": {"pp": 2, "dp_replicate": 2},
           "pp2_tp2": {"pp": 2, "tp": 2}}
CLIP = {"llama": 0.05, "gpt": 0.05}
INIT_MODULE = {"pp2_dp_shard2", "pp2_tp2"}  # built under pt.init_module() (the checkpointed run is built whole)


# a 4-block GPT in 4 stages, 2 a pipeline rank; zero bubble: each backward split in two (input, then weight gradients)
INTERLEAVED = {"schedule": "interleavedzerobubble", "stages_per_rank": 2}


def build(kind: str) -> torch.nn.Module:
    return zoo.GPT() if kind == "gpt" else zoo.GPT(n_layer=4) if kind == "gpt4" else zoo.hf_model(kind)


def train(mesh: dict[str, int] | None, kind: str, steps: int = STEPS, save: str | None = None,
          load: str | None = None, init_module: bool = False, pipeline: dict | None = None) -> dict[str, torch.Tensor]:
    pt = paratrain.Parallel(global_batch=GLOBAL_BATCH, seed=SEED, clip_grad_norm=CLIP.get(kind, 0.05),
                            **({"mesh": mesh} if mesh else {}), **({"pipeline": pipeline} if pipeline else {}))
    with pt.init_module() if init_module else contextlib.nullcontext():  # on the meta device: each rank its stage's part
        model = build(kind).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt = pt.setup(model, opt)
    if load:
        pt.load_checkpoint(load, model, opt)
    for batch in pt.train_loader(zoo.Tokens(N)):
        if pt.global_step == steps:
            break
        opt.zero_grad()
        pt.training_step(model, batch, zoo.loss_of)
        opt.step()
    if save:
        pt.save_checkpoint(save, model, opt)
    state = pt.full_state_dict(model)
    # 7 samples over 2 replicas in batches of 4: shards of 4 and 3, padded to as many forwards (each stage is
    # sharded over the replicas: a forward one replica ran alone would wait for the other)
    state["eval"] = torch.tensor(pt.evaluate(model, pt.eval_loader(zoo.Tokens(7), batch_size=4), loss_fn=zoo.loss_of)["count"])
    pt.close()
    return state


def worker(rank: int, folder: str) -> dict[str, object]:
    out: dict[str, object] = {f"{name}/{kind}": train(mesh, kind, init_module=name in INIT_MODULE)
                              for name, mesh in LAYOUTS.items() for kind in CLIP}
    out["interleaved/gpt4"] = train(LAYOUTS["pp2_dp_shard2"], "gpt4", init_module=True, pipeline=INTERLEAVED)
    out["zbv/gpt4"] = train(LAYOUTS["pp2_tp2"], "gpt4", pipeline={"schedule": "zbvzerobubble"})
    out["zbv_dp/gpt4"] = train(LAYOUTS["pp2_dp_shard2"], "gpt4", init_module=True, pipeline={"schedule": "zbvzerobubble"})
    train(LAYOUTS["pp2_dp_shard2"], "llama", steps=1, save=folder)
    return out


def resume_worker(rank: int, folder: str) -> dict[str, torch.Tensor]:
    return train({"dp_shard": 4}, "llama", load=folder)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = str(tmp_path_factory.mktemp("pp") / "checkpoints")
    out = paratrain.launch(worker, nprocs=4, args=(folder,), timeout=240)[0]
    out["resumed"] = paratrain.launch(resume_worker, nprocs=4, args=(folder,), timeout=120)[0]
    return out


def reference(kind: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    return zoo.train_plain(lambda: build(kind), steps=steps, global_batch=GLOBAL_BATCH, seed=SEED, data=zoo.Tokens(N),
                           clip_grad_norm=CLIP.get(kind, 0.05))


@pytest.mark.parametrize("kind", list(CLIP))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipelines_side_by_side_equal_one_process(world4, layout, kind):
    ref = reference(kind)
    got = world4[f"{layout}/{kind}"]
    assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-9)
    assert int(got["eval"]) == 7  # every sample evaluated once


def test_interleaved_stages_sharded_over_their_replicas_equal_one_process(world4):
    """pp2 x dp_shard2 with two stages a pipeline rank (InterleavedZeroBubble), built under init_module: each of a
    rank's stages sharded over its replicas, the tied embedding on stages 0 and 3, one clipping norm, evaluation.
    Its weight gradients come after other micro-batches' forwards: the stages stay gathered for the step, and their
    gradients are reduced at its end (they were lost before, and the ranks' norms disagreed in dtype)."""
    ref = reference("gpt4")
    got = world4["interleaved/gpt4"]
    assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-9)
    assert int(got["eval"]) == 7


def test_a_v_shaped_schedule_split_over_tp_equals_one_process(world4):
    """pp2 x tp2 under ZBVZeroBubble: pipeline rank 0 holds stages 0 and 3 (both ends of the tied embedding), rank 1
    stages 1 and 2, each split over its tp ranks; the evaluation runs the V's forwards."""
    ref = reference("gpt4")
    got = world4["zbv/gpt4"]
    assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-9)
    assert int(got["eval"]) == 7


def test_a_v_shaped_schedule_sharded_over_replicas_equals_one_process(world4):
    """pp2 x dp_shard2 under ZBVZeroBubble, built under init_module: pipeline rank 0 holds stages 0 and 3, rank 1
    stages 1 and 2, each sharded over its replicas. The embedding tied to the head is on stages 0 and 3 of rank 0:
    it stays whole on each replica (two FSDP2 units would shard it apart), its gradient averaged over them."""
    ref = reference("gpt4")
    got = world4["zbv_dp/gpt4"]
    assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-9)
    assert int(got["eval"]) == 7


def test_a_checkpoint_of_pp2_dp_shard2_resumes_under_dp_shard4(world4):
    ref = reference("llama")
    assert_same_state({k: world4["resumed"][k] for k in ref}, ref, rtol=1e-9)


# --------------------------------------------------------------------------- 3-D, world size 8


THREE_D = {"pp": 2, "dp_shard": 2, "tp": 2}


def worker3d(rank: int, chain: str) -> dict[str, dict[str, torch.Tensor]]:
    out = {kind: train(THREE_D, kind) for kind in CLIP}
    train(THREE_D, "llama", steps=2, load=f"{chain}/1", save=f"{chain}/2")  # the chain's second step
    return out


def chain_worker(rank: int, chain: str, mesh: dict[str, int], step: int) -> None:
    train(mesh, "llama", steps=step, load=f"{chain}/{step - 1}", save=f"{chain}/{step}")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The chain's first step, in this process: a checkpoint of one process for the 3-D layout to resume."""
    pytest.importorskip("transformers")
    folder = str(tmp_path_factory.mktemp("chain"))
    train(None, "llama", steps=1, save=f"{folder}/1")
    return folder


@pytest.fixture(scope="module")
def world8(chain):
    return paratrain.launch(worker3d, nprocs=8, args=(chain,), timeout=280)[0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", list(CLIP))
def test_pp2_dp_shard2_tp2_equals_one_process(world8, kind):
    ref = reference(kind)
    assert_same_state({k: world8[kind][k] for k in ref}, ref, rtol=1e-9)


@pytest.mark.timeout(400)
def test_one_run_handed_from_layout_to_layout_equals_one_process(world8, chain):
    """A checkpoint of any layout resumes under any other: each step of the run in another layout
    (single -> pp2 x dp_shard2 x tp2 -> dp_shard=4 -> pp2 x tp2 -> single), ending on plain PyTorch's fifth step."""
    paratrain.launch(chain_worker, nprocs=4, args=(chain, {"dp_shard": 4}, 3), timeout=120)
    paratrain.launch(chain_worker, nprocs=4, args=(chain, {"pp": 2, "tp": 2}, 4), timeout=120)
    got = train(None, "llama", steps=5, load=f"{chain}/4")
    ref = reference("llama", steps=5)
    assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-9)


class LastPositionGPT(zoo.GPT):
    """nanoGPT's own forward: without targets, only the last position's logits (its inference shortcut)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(idx)
        return logits if targets is not None else logits[:, [-1], :]


def test_a_model_that_gives_only_the_last_position_is_refused_in_one_line():
    pt = paratrain.Parallel(strategy="pipeline", global_batch=GLOBAL_BATCH, seed=SEED)
    model = pt.setup(LastPositionGPT())
    batch = next(iter(pt.train_loader(zoo.Tokens(N))))
    with pytest.raises(ValueError) as e:
        pt.training_step(model, batch, zoo.loss_of)
    line = str(e.value)
    assert "\n" not in line and "LastPositionGPT returned outputs of shape (2, 1, " in line
    assert "make forward return every position's logits when targets is None" in line
    pt.close()
