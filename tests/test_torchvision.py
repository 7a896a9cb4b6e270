"""torchvision as users have it, beside PyPI's CUDA build of torch (the smoke run of
``scripts/test.sh``; skipped where torchvision does not import, as beside the CPU build): a
``torchvision:<name>`` model and a ``torchvision:<Class>`` dataset through ``paratrain train``, and a
torchvision dataset with random per-sample transforms in a user's own loop, which trains to the same
weights at world sizes 1 and 2 (each sample's draws are seeded by the sample, not by the rank)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import paratrain
from clitools import run_cli

tv = pytest.importorskip("torchvision")
pytestmark = [pytest.mark.smoke, pytest.mark.timeout(200)]

STEPS, BATCH, SEED = 4, 8, 3


def write_mnist(root: Path, n_train: int = 128, n_test: int = 32) -> None:
    """MNIST's four raw idx files (what torchvision reads with ``download=False``), made up here."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        images = (rng.random((n, 28, 28)) * 64).astype(np.uint8) + labels[:, None, None] * 19
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + labels.tobytes())


def test_paratrain_train_reads_a_torchvision_dataset(tmp_path: Path) -> None:
    write_mnist(tmp_path / "data")
    r = run_cli(["train", "--dataset", "torchvision:MNIST", "--data-dir", str(tmp_path / "data"), "--nproc-per-node",
                 "2", "--max-steps", "2", "--global-batch", "32", "--no-progress", "--log-dir", str(tmp_path / "run")],
                timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps"] == 2 and result["world_size"] == 2 and result["test_count"] == 32


def test_paratrain_train_builds_a_torchvision_model(tmp_path: Path) -> None:
    r = run_cli(["train", "--model", "torchvision:resnet18", "--dataset", "synthetic", "--set", "data.synthetic_size=64",
                 "--nproc-per-node", "2", "--max-steps", "2", "--global-batch", "16", "--no-progress", "--log-dir",
                 str(tmp_path / "run")], timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps"] == 2 and result["config"]["model"] == "torchvision:resnet18"


def train(rank: int = 0) -> dict[str, torch.Tensor]:
    """``STEPS`` steps of a linear classifier on FakeData through RandomCrop and RandomHorizontalFlip."""
    from torchvision import transforms

    augment = transforms.Compose([transforms.RandomCrop(8, padding=2), transforms.RandomHorizontalFlip(),
                                  transforms.ToTensor()])
    data = tv.datasets.FakeData(size=64, image_size=(3, 8, 8), num_classes=4, transform=augment)
    pt = paratrain.Parallel(strategy="ddp", global_batch=BATCH, seed=SEED)
    torch.manual_seed(SEED)
    model = nn.Linear(3 * 8 * 8, 4).double()
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    for x, y in pt.train_loader(data):
        if pt.global_step == STEPS:
            break
        pt.backward(nn.functional.cross_entropy(model(x.flatten(1).double()), y))
        opt.step()
        opt.zero_grad()
    state = pt.full_state_dict(model)
    pt.close()
    return state


def test_a_torchvision_dataset_with_random_transforms_trains_the_same_at_world_sizes_1_and_2() -> None:
    one = train()
    for state in paratrain.launch(train, nprocs=2, timeout=120):
        assert state.keys() == one.keys()
        assert all(torch.allclose(state[k], one[k], rtol=1e-10, atol=0) for k in one), \
            {k: (state[k] - one[k]).abs().max().item() for k in one}
