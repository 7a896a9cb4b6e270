"""``paratrain export`` / ``save_model`` / ``load_model``: a run's weights as safetensors, from any strategy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from clitools import run_cli  # noqa: E402
from paratrain.checkpoint import load_latest, load_model, save_model  # noqa: E402
from paratrain.models.registry import build_model  # noqa: E402

pytestmark = pytest.mark.timeout(200)


def test_save_and_load_model_round_trip(tmp_path: Path) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    save_model(net.state_dict(), tmp_path / "m", {"note": "x"})
    got = load_model(tmp_path / "m")
    assert got.keys() == net.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in net.state_dict().items())
    assert json.loads((tmp_path / "m" / "paratrain.json").read_text()) == {"note": "x"}
    with pytest.raises(FileNotFoundError, match="no exported model"):
        load_model(tmp_path / "nothing")


def _train_and_export(tmp_path: Path, strategy: str) -> tuple[Path, dict[str, torch.Tensor]]:
    run = tmp_path / strategy
    res = run_cli(["train", "--strategy", strategy, "--nproc-per-node", "2", "--max-steps", "3",
                   "--checkpoint-every", "3", "--no-progress", "--log-dir", str(run)], timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_cli(["export", str(run), "--out", str(tmp_path / f"{strategy}-out")], timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads((tmp_path / f"{strategy}-out" / "paratrain.json").read_text())
    assert info["global_step"] == 3 and info["sharded"] == (strategy == "fsdp")
    assert info["config"]["parallel"]["strategy"] == strategy
    return run, load_model(tmp_path / f"{strategy}-out")


def test_export_plain_and_sharded_runs(tmp_path: Path) -> None:
    """A ddp run (plain checkpoint) and an fsdp run (sharded through DCP) of the same job export the
    user's keys, unsharded, and the same weights."""
    run, ddp = _train_and_export(tmp_path, "ddp")
    _, fsdp = _train_and_export(tmp_path, "fsdp")
    net = build_model("mlp", (1, 8, 8), 10)
    net.load_state_dict(fsdp)  # loads into the plain module
    _, state = load_latest(run / "checkpoints")
    assert all(torch.equal(ddp[k], v) for k, v in state["model"].items())  # exactly the checkpoint's tensors
    for k in ddp:  # 3 SGD steps of the same job in fp32: both strategies equal a one-process loop to ~1e-7
        assert torch.allclose(fsdp[k], ddp[k], rtol=1e-5, atol=1e-6), k


def test_export_without_checkpoint_is_one_line(tmp_path: Path) -> None:
    res = run_cli(["export", str(tmp_path)], timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "no checkpoint in" in lines[0], res.stderr


def test_export_of_master_weights_is_the_fp32_masters(tmp_path: Path) -> None:
    """bf16-true: the export holds the fp32 masters the optimizer stepped (a tied weight under both
    names), not the model's rounded bf16 copy; buffers stay as they are."""
    import paratrain
    from paratrain.checkpoint import export_checkpoint

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)
            self.b.weight = self.a.weight
            self.norm = torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return self.b(self.norm(self.a(x)))

    pt = paratrain.Parallel(strategy="single", precision="bf16-true", global_batch=8)
    net = Tied()
    model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(8, 4)
    opt.zero_grad()
    pt.backward(model(x).float().pow(2).mean())
    opt.step()
    pt.save_checkpoint(str(tmp_path / "ck"), model, opt)
    export_checkpoint(tmp_path / "ck", tmp_path / "out")
    got = load_model(tmp_path / "out")
    masters = dict(zip(pt.precision._names, pt.precision.masters_state()))
    assert torch.equal(got["a.weight"], masters["a.weight"]) and torch.equal(got["b.weight"], masters["a.weight"])
    assert got["a.weight"].dtype == torch.float32 and torch.equal(got["a.bias"], masters["a.bias"])
    assert not torch.equal(got["a.weight"], net.a.weight.float())  # the rounded copy differs
    assert torch.equal(got["norm.running_mean"], net.norm.running_mean)
    pt.close()
