import sys

import pytest
import torch
from torch import nn

from paratrain.models import MLP, MODEL_NAMES, SmallCNN, build_model, resnet_cifar
from paratrain.strategies._split import check_sequential, split_model

SHAPES = {"digits": (1, 8, 8), "cifar": (3, 32, 32)}


IMAGE_MODELS = [n for n in MODEL_NAMES if not n.startswith("gpt")]


@pytest.mark.parametrize("name", IMAGE_MODELS)
@pytest.mark.parametrize("data", sorted(SHAPES))
def test_forward_shapes(name, data):
    torch.manual_seed(0)
    shape = SHAPES[data]
    model = build_model(name, shape, num_classes=7)
    out = model(torch.randn(4, *shape))
    assert out.shape == (4, 7)
    out.sum().backward()


def test_mlp_matches_seed_003():
    m = MLP()
    assert m.fc1.in_features == 784 and m.fc1.out_features == 512 and m.fc2.out_features == 10
    x = torch.randn(3, 1, 28, 28)
    logp = MLP(log_softmax=True)
    logp.load_state_dict(m.state_dict())
    assert torch.allclose(logp(x), torch.log_softmax(m(x), 1))
    assert torch.allclose(logp(x).exp().sum(1), torch.ones(3))


def test_mlp_is_its_children_in_order_so_pipeline_can_cut_it():
    torch.manual_seed(0)
    m = MLP(64, 16, 10)
    assert [n for n, _ in m.named_children()] == ["flatten", "fc1", "relu", "fc2"]
    assert list(m.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # checkpoints unchanged
    x = torch.randn(4, 1, 8, 8)
    assert torch.equal(m(x), nn.Sequential(*m.children())(x))
    for n_parts in (2, 4):
        parts = split_model(m, n_parts)
        assert len(parts) == n_parts and sum(len(p) for p in parts) == 4
        check_sequential(m, parts, x, "pipeline")  # raises if the parts do not compute m(x)
    assert [list(dict(p.named_children())) for p in split_model(m, 2)] == [["flatten", "fc1"], ["relu", "fc2"]]
    logp = MLP(64, 16, 10, log_softmax=True)  # log_softmax runs outside the children: not a plain chain
    with pytest.raises(ValueError, match="MLP.forward is not its top-level children called in order"):
        check_sequential(logp, split_model(logp, 2), x, "pipeline")


def test_resnet_depths_and_batchnorm():
    r8, r20 = resnet_cifar(8), resnet_cifar(20)
    n_params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n_params(r8) < n_params(r20)
    assert 250_000 < n_params(r20) < 300_000  # He et al.'s ResNet-20 has ~0.27M parameters
    assert any(isinstance(m, nn.BatchNorm2d) for m in r8.modules())
    with pytest.raises(ValueError, match="depth 9"):
        resnet_cifar(9)
    assert SmallCNN(1, 3)(torch.randn(2, 1, 8, 8)).shape == (2, 3)


def test_unknown_model():
    with pytest.raises(ValueError, match="resnet20"):
        build_model("vgg", (3, 32, 32), 10)


def test_conv_model_needs_image_shape():
    with pytest.raises(ValueError, match="mlp"):
        build_model("resnet8", (64,), 10)
    assert build_model("mlp", (64,), 10)(torch.randn(2, 64)).shape == (2, 10)


def test_torchvision_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    with pytest.raises(ValueError, match="torchvision is not installed"):
        build_model("torchvision:resnet50", (3, 32, 32), 10)
    with pytest.raises(ValueError, match=r"pip install 'paratrain\[data\]'"):
        build_model("torchvision:resnet50", (3, 32, 32), 10)


def test_every_extra_a_message_names_exists():
    """The extras that one-line errors tell users to install are declared in pyproject.toml."""
    import re
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # python 3.10
        import tomli as tomllib
    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = set()
    for path in (root / "paratrain").rglob("*.py"):
        named |= set(re.findall(r"paratrain\[(\w+)\]", path.read_text()))
    assert named and named <= set(extras), named - set(extras)
    assert {"data", "hf", "trackers", "all"} <= set(extras)
    assert set(extras["all"]) >= {dep for name, deps in extras.items() if name not in ("all", "test") for dep in deps}


def test_resnet50_is_torchvisions_architecture():
    # torchvision.models.resnet50(weights=None): 25,557,032 parameters, 53 convolutions and one linear layer
    model = build_model("resnet50", (3, 224, 224), num_classes=1000)
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    assert sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in model.modules()) == 54


def test_the_built_in_gpt_is_nanogpts_model_returning_every_position():
    from paratrain.models.gpt import GPT, GPTConfig, flops_per_token, token_loss

    torch.manual_seed(0)
    model = build_model("gpt", (16,), num_classes=50)
    assert isinstance(model, GPT) and model.config == GPTConfig(block_size=16, vocab_size=50, n_layer=4, n_head=4,
                                                                n_embd=128)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as nanoGPT ties them
    idx = torch.randint(0, 50, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 50)  # every position, in training and out
    loss = token_loss(logits, idx)
    torch.testing.assert_close(loss, nn.functional.cross_entropy(logits.reshape(-1, 50), idx.reshape(-1)))
    loss.backward()
    names = [n for n, _ in model.named_parameters()]  # nanoGPT's names: its checkpoints load
    assert names[:3] == ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight"]
    assert "transformer.h.3.attn.c_attn.weight" in names and "lm_head.weight" not in names  # tied: listed once
    gpt2 = GPTConfig()  # GPT-2 124M: nanoGPT's 6N + 12LHQT
    assert (gpt2.n_layer, gpt2.n_embd, gpt2.vocab_size, gpt2.block_size) == (12, 768, 50304, 1024)
    n = sum(p.numel() for p in model.parameters()) - 16 * 128
    assert flops_per_token(model) == 6 * n + 12 * 4 * 4 * 32 * 16
    with pytest.raises(ValueError, match=r"reads windows of tokens, shape \(T,\), got \(3, 32, 32\)"):
        build_model("gpt", (3, 32, 32), num_classes=10)
    with pytest.raises(ValueError, match="more than its block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
