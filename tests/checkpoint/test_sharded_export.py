"""``paratrain export`` of an fsdp run as HuggingFace writes a large model (issue 28, item 5):
numbered safetensors files of at most ``--max-shard-size`` plus ``model.safetensors.index.json``,
each file's tensors read from the sharded checkpoint alone (never the whole model at once), and a
folder that ``transformers``' ``from_pretrained`` loads to the trained weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import zoo
from clitools import run_cli

import paratrain
from paratrain.checkpoint import export_checkpoint, load_model
from paratrain.checkpoint.export import parse_size

pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)
LIMIT = 6000  # bytes: the tiny GPT-2 (about 26 kB) becomes several files


def _worker(rank: int, folder: str) -> dict[str, torch.Tensor]:
    """Two SGD steps of a tiny tied GPT-2 under fsdp at world size 2, saved as a sharded checkpoint."""
    pt = paratrain.Parallel(strategy="fsdp", global_batch=8, seed=5)
    model = zoo.hf_model("gpt2")
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    for step, (ids, target) in enumerate(pt.train_loader(zoo.Tokens(32))):
        if step == 2:
            break
        opt.zero_grad()
        pt.backward(zoo.loss_of(model(ids), target))
        opt.step()
    pt.save_checkpoint(folder, model, opt)
    state = pt.full_state_dict(model)
    pt.close()
    return state


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("fsdp") / "checkpoints"
    state, _ = paratrain.launch(_worker, nprocs=2, args=(str(folder),), timeout=240)
    return folder, state


def test_an_fsdp_run_exports_in_files_that_from_pretrained_loads(trained, tmp_path: Path, monkeypatch) -> None:
    import torch.distributed.checkpoint as dcp

    folder, state = trained
    read: list[int] = []
    load = dcp.load

    def recording(state_dict, **kwargs):  # what each read asks DCP for: one file's tensors
        read.append(sum(t.numel() * t.element_size() for t in state_dict["model"].values()))
        return load(state_dict, **kwargs)

    monkeypatch.setattr(dcp, "load", recording)
    config = tmp_path / "hf"
    zoo.hf_model("gpt2").config.save_pretrained(config)
    index_path = export_checkpoint(folder, tmp_path / "out", max_shard_size=LIMIT, hf_config=config)

    index = json.loads(index_path.read_text())
    files = sorted({*index["weight_map"].values()})
    assert index_path.name == "model.safetensors.index.json" and len(files) >= 3
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    largest = max(t.numel() * t.element_size() for t in state.values())
    assert len(read) == len(files) and max(read) <= max(LIMIT, largest) < sum(read), read
    assert index["metadata"]["total_size"] == sum(read)
    assert not (tmp_path / "out" / "model.safetensors").exists()

    exported = load_model(tmp_path / "out")
    assert exported.keys() == {k for k in state if k in index["weight_map"]}
    assert all(torch.equal(exported[k], state[k]) for k in exported)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items() if k in got)
    assert torch.equal(got["lm_head.weight"], state["transformer.wte.weight"])  # tied, as trained


def test_the_cli_exports_in_files_and_a_new_export_replaces_the_old_files(trained, tmp_path: Path) -> None:
    folder, state = trained
    out = tmp_path / "out"
    res = run_cli(["export", str(folder), "--out", str(out), "--max-shard-size", "6KB"], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "model.safetensors.index.json" in res.stdout
    assert len(list(out.glob("model-*.safetensors"))) >= 3
    res = run_cli(["export", str(folder), "--out", str(out)], timeout=120)  # 5GB: one file
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "paratrain.json"]
    assert all(torch.equal(load_model(out)[k], state[k]) for k in load_model(out))
    res = run_cli(["export", str(folder), "--out", str(out), "--max-shard-size", "5 apples"], timeout=60)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "'5 apples' is not a size" in res.stderr
    res = run_cli(["export", str(folder), "--out", str(out), "--hf-config", str(tmp_path)], timeout=60)
    assert res.returncode == 2 and "holds no config.json" in res.stderr, res.stderr


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("1.5GiB", 3 * 2**29),
                                        ("123", 123), (4096, 4096), ("2 kb", 2000)])
def test_sizes_read_as_transformers_reads_them(text, size) -> None:
    assert parse_size(text) == size


def _load_worker(rank: int, folder: str) -> dict[str, object]:
    """A tiny GPT-2 built on the meta device under fsdp, its weights loaded from an export."""
    pt = paratrain.Parallel(strategy="fsdp", seed=9)
    with pt.init_module():
        model = zoo.hf_model("gpt2")
    model = pt.setup(model)
    pt.load_weights(model, folder)
    local = sum(p.to_local().numel() for p in pt.unwrap(model).parameters())
    state = pt.full_state_dict(model)
    pt.close()
    return {"state": state, "local": local}


def test_exported_weights_load_into_a_sharded_meta_built_model(trained, tmp_path: Path) -> None:
    """Issue 28, item 1: each rank reads only its shards of each tensor into a model that was never whole."""
    from paratrain.checkpoint import save_model

    _, state = trained
    save_model(state, tmp_path / "w", max_shard_size=LIMIT)
    ranks = paratrain.launch(_load_worker, nprocs=2, args=(str(tmp_path / "w"),), timeout=240)
    total = sum(p.numel() for p in zoo.hf_model("gpt2").parameters())
    for r in ranks:
        assert all(torch.equal(r["state"][k], v) for k, v in state.items())
        assert r["local"] < 0.6 * total


def test_save_pretrained_weights_load_in_one_process_and_a_wrong_model_is_one_line(trained, tmp_path: Path) -> None:
    _, state = trained
    hf = zoo.hf_model("gpt2")
    hf.load_state_dict(state)
    hf.save_pretrained(tmp_path / "hf")  # one name of the tied weight only
    pt = paratrain.Parallel(seed=1)
    model = pt.setup(zoo.hf_model("gpt2"))
    pt.load_weights(model, tmp_path / "hf")
    assert all(torch.equal(v, state[k]) for k, v in pt.unwrap(model).state_dict().items())
    with pytest.raises(ValueError, match="of the model's entries are not in"):
        pt.load_weights(pt.setup(zoo.hf_model("llama")), tmp_path / "hf")
    wider = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=zoo.VOCAB))
    with pytest.raises(ValueError, match="holds a tensor of shape"):
        pt.load_weights(pt.setup(wider), tmp_path / "hf", strict=False)
    pt.close()
