"""fsdp's defaults on models as users build them (issue 28, item 0): a root that holds its blocks
in a ``ModuleList``/``ModuleDict`` (nanoGPT, a plain block stack), tied weights (GPT-2, nanoGPT), a
BERT classifier and a Llama, each under plain ``Parallel(strategy="fsdp")`` at world size 2 in
float64, against the plain PyTorch loop written here in one process."""

from __future__ import annotations

import pytest
import torch
import zoo
from parity import assert_same_state
from torch import nn

import paratrain
from paratrain.launch.spawn import LaunchError, exception_line
from paratrain.strategies.fsdp import _blocks

pytestmark = pytest.mark.timeout(300)
GLOBAL_BATCH, STEPS, SEED, N = 8, 4, 3, 32
PLAIN = ("gpt", "blocknet")
HF = ("gpt2", "bert", "llama")


def build(kind: str) -> nn.Module:
    if kind == "gpt":
        return zoo.GPT()
    if kind == "blocknet":
        return zoo.BlockNet()
    return zoo.hf_model(kind)


def data(kind: str) -> zoo.Tokens:
    return zoo.Tokens(N, classes=2 if kind == "bert" else None)


def train_fsdp(kind: str) -> dict[str, torch.Tensor]:
    return zoo.train_parallel(lambda: build(kind), "fsdp", steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED,
                              data=data(kind))


def worker(rank: int, kinds: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    out = {kind: train_fsdp(kind) for kind in kinds}
    paratrain.Parallel(strategy="fsdp").close()
    return out


def reference(kind: str) -> dict[str, torch.Tensor]:
    """Plain PyTorch in one process, over paratrain's documented sample order."""
    return zoo.train_plain(lambda: build(kind), steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED, data=data(kind))


@pytest.fixture(scope="module")
def world2():
    kinds = PLAIN + (HF if _has_transformers() else ())
    (rank0, _) = paratrain.launch(worker, nprocs=2, args=(kinds,), timeout=240)
    return rank0


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("kind", PLAIN + HF)
def test_default_fsdp_equals_one_process(world2, kind):
    if kind in HF:
        pytest.importorskip("transformers")
    ref = reference(kind)
    got = world2[kind]
    # float64: 1e-8 (BERT's attention key bias gets a gradient that softmax nearly cancels: ~1e-10)
    assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-8)


def test_default_blocks_are_the_stacks_elements_never_a_container():
    assert [type(b).__name__ for b in _blocks(zoo.GPT(), [], 0)] == ["Block", "Block"]
    assert [type(b).__name__ for b in _blocks(zoo.BlockNet(), [], 0)] == ["Sequential"] * 3
    stack_of_stacks = nn.Sequential(nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])]))
    assert all(isinstance(b, nn.Linear) for b in _blocks(stack_of_stacks, [], 0))


def test_tied_weights_stay_in_one_group():
    gpt = zoo.GPT()
    wte, head = gpt.transformer.wte, gpt.lm_head
    # wte and lm_head share a weight: neither is a block of its own, whatever the policy says
    for classes in ([], ["Embedding", "Linear", "Block"]):
        blocks = _blocks(gpt, classes, 0)
        assert not any(b is wte or b is head for b in blocks)
    assert any(type(b).__name__ == "Block" for b in _blocks(gpt, ["Embedding", "Linear", "Block"], 0))


def _raise_multiline(rank: int) -> None:
    raise ValueError("fully_shard does not support containers that do not implement forward: ModuleList(\n"
                     "  (0-1): 2 x Block(\n  )\n)")


def test_a_workers_multiline_error_is_one_meaningful_line():
    with pytest.raises(LaunchError) as e:
        paratrain.launch(_raise_multiline, nprocs=1, timeout=60)
    line = str(e.value)
    assert "\n" not in line and line.startswith("rank 0 failed: ValueError: fully_shard does not support"), line
    assert exception_line("Traceback (most recent call last):\n  File 'x'\nKeyError: 'a'\n") == "KeyError: 'a'"
