"""What big models need (issue 28, items 2 and 3): activation checkpointing under single, ddp and
fsdp, equal to plain PyTorch without it (float64, world sizes 1 and 2); fsdp's CPU offload hands
FSDP2 its CPUOffloadPolicy on an accelerator (simulated here: the policy needs a GPU to run) and is a
no-op with a warning on the CPU, where the run still equals plain PyTorch."""

from __future__ import annotations

import pytest
import torch
import zoo
from parity import assert_same_state

import paratrain
from paratrain.nn.checkpointing import apply_activation_checkpointing

pytestmark = pytest.mark.timeout(300)
GLOBAL_BATCH, STEPS, SEED, N = 8, 3, 7, 24


def train(strategy: str, **options) -> dict[str, torch.Tensor]:
    recomputed = []

    def make() -> torch.nn.Module:
        model = zoo.GPT()
        recomputed.append(model)
        return model

    state = zoo.train_parallel(make, strategy, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED, data=zoo.Tokens(N),
                               **options)
    state["recomputed blocks"] = torch.tensor(sum(getattr(m, "_paratrain_checkpointed", False)
                                                  for m in recomputed[0].modules()))
    return state


CASES = {
    "ddp + checkpointing": ("ddp", {"activation_checkpointing": ["Block"]}),
    "fsdp + checkpointing": ("fsdp", {"activation_checkpointing": [zoo.Block]}),
    "fsdp + offload": ("fsdp", {"fsdp": {"cpu_offload": True}}),
    "fsdp + offload + checkpointing": ("fsdp", {"fsdp": {"cpu_offload": True},
                                               "activation_checkpointing": lambda m: isinstance(m, zoo.Block)}),
}


def worker(rank: int) -> dict[str, dict[str, torch.Tensor]]:
    out = {name: train(strategy, **options) for name, (strategy, options) in CASES.items()}
    paratrain.Parallel(strategy="ddp").close()
    return out


def reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process, no checkpointing."""
    return zoo.train_plain(zoo.GPT, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED, data=zoo.Tokens(N))


@pytest.fixture(scope="module")
def world2():
    rank0, _ = paratrain.launch(worker, nprocs=2, timeout=240)
    return rank0


@pytest.mark.parametrize("case", list(CASES))
def test_world_size_2_equals_plain_pytorch(world2, case):
    got = dict(world2[case])
    blocks = got.pop("recomputed blocks").item()
    assert blocks == (2 if "checkpointing" in case else 0)
    assert_same_state({k: got[k] for k in reference()}, reference(), rtol=1e-10)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_world_size_1_with_checkpointing_equals_plain_pytorch(strategy):
    got = train(strategy, activation_checkpointing=["Block"])
    assert got.pop("recomputed blocks").item() == 2
    assert_same_state({k: got[k] for k in reference()}, reference(), rtol=1e-10)


def test_checkpointing_saves_only_block_inputs():
    """What autograd keeps falls: counted with saved-tensor hooks, not timed."""
    def saved_bytes(model):
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            zoo.loss_of(model(zoo.Tokens(8).ids), zoo.Tokens(8).target)
        return total

    torch.manual_seed(0)
    plain = saved_bytes(zoo.GPT(n_layer=4))
    torch.manual_seed(0)
    model = zoo.GPT(n_layer=4)
    assert apply_activation_checkpointing(model, ["Block"]) == [f"transformer.h.{i}" for i in range(4)]
    assert saved_bytes(model) < plain / 2


def test_cpu_offload_hands_fsdp2_its_policy_on_an_accelerator(monkeypatch):
    import torch.distributed.fsdp as fsdp2

    from paratrain.strategies.fsdp import FSDPOptions, shard_model

    seen = []
    monkeypatch.setattr(fsdp2, "fully_shard", lambda module, **kw: seen.append((module, kw)) or module)

    class CudaMesh:
        device_type = "cuda"

    model = zoo.GPT()
    shard_model(model, CudaMesh(), FSDPOptions(cpu_offload=True))
    assert seen and all(isinstance(kw["offload_policy"], fsdp2.CPUOffloadPolicy) for _, kw in seen)
    assert seen[-1][0] is model  # the root last, with the same policy
    seen.clear()
    shard_model(model, CudaMesh(), FSDPOptions())
    assert all("offload_policy" not in kw for _, kw in seen)


def test_a_policy_that_matches_nothing_is_one_line():
    with pytest.raises(ValueError, match="matches no module of GPT: its classes are"):
        apply_activation_checkpointing(zoo.GPT(), ["Blok"])
    with pytest.raises(ValueError, match="must name block classes"):
        paratrain.Parallel(strategy="single", activation_checkpointing=[3])
