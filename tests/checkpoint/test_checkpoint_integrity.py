"""Checkpoint integrity: a damaged or crafted checkpoint never runs code and is never loaded.

Every file of a checkpoint is checked against the SHA-256 digests of its manifest before torch
reads it; ``.pt`` files load with ``weights_only=True``, DCP metadata and entries through
restricted loaders. A bad newest checkpoint falls back to the newest good one; none good is one
error line. Sharded strategies (fsdp, tensor, pipeline) run in 2 real processes over gloo.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.checkpoint import CheckpointError, load_file, load_latest, write_checkpoint
from paratrain.config import TrainConfig
from paratrain.loop import fit
from paratrain.loop.train import run_training
from clitools import run_cli

TORCH_ADVICE = ("weights_only=False", "`weights_only` set to `False`", "Re-running")


class Evil:
    """Unpickling it runs ``touch marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def assert_one_clean_line(message: str) -> None:
    assert "\n" not in message, message
    assert not any(a in message for a in TORCH_ADVICE), message


def flip_bit(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def two_checkpoints(d: Path) -> Path:
    """step 1 and step 2 in ``d``; returns step 2's file."""
    write_checkpoint(d, 1, {"step": 1, "w": torch.arange(2000.0)})
    return write_checkpoint(d, 2, {"step": 2, "w": torch.arange(2000.0) * 2})


# --- single files: one process ---------------------------------------------------------------

CORRUPTIONS = {
    "truncated": lambda b: b[: len(b) // 3],
    "empty": lambda b: b"",
    "random bytes": lambda b: random.Random(0).randbytes(len(b)),
    "opcode only": lambda b: b"\x80\x02t",  # torch raises IndexError on it
    "bit flip": lambda b: bytes([b[0] ^ 0x04]) + b[1:],
}


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no manifest"])
def test_damaged_newest_file_falls_back_to_previous_good_one(tmp_path, manifest):
    for name, damage in CORRUPTIONS.items():
        if name == "bit flip" and not manifest:
            continue  # without a digest a flipped bit can load: that is what the manifest is for
        d = tmp_path / name.replace(" ", "-")
        newest = two_checkpoints(d)
        newest.write_bytes(damage(newest.read_bytes()))
        if not manifest:
            newest.with_suffix(".sha256").unlink()
            with pytest.raises(CheckpointError) as e:
                load_file(newest)  # the loader itself: every exception torch raises is one line
            assert_one_clean_line(str(e.value))
        with pytest.warns(UserWarning) as record:
            path, state = load_latest(d)
        assert path.name == "step-00000001.pt" and state["step"] == 1, name
        skipped = [str(w.message) for w in record if "using an older checkpoint" in str(w.message)]
        assert len(skipped) == 1 and "step-00000002.pt" in skipped[0], (name, skipped)
        assert_one_clean_line(skipped[0])
        if manifest:
            assert "SHA-256" in skipped[0]


def test_other_content_and_bad_manifests_are_caught(tmp_path):
    # A well-formed checkpoint in the wrong place: only its digest tells.
    newest = two_checkpoints(tmp_path / "swap")
    shutil.copy(tmp_path / "swap" / "step-00000001.pt", newest)
    with pytest.warns(UserWarning, match="SHA-256"):
        assert load_latest(tmp_path / "swap")[1]["step"] == 1
    # A garbled manifest, or one naming a file outside its checkpoint, disqualifies it.
    for case, text in {"garbled": b"\xff\xfe nonsense\n", "outside": b"0" * 64 + b"  ../escape\n"}.items():
        newest = two_checkpoints(tmp_path / case)
        newest.with_suffix(".sha256").write_bytes(text)
        with pytest.warns(UserWarning, match="manifest"):
            assert load_latest(tmp_path / case)[1]["step"] == 1
    # A garbled latest pointer: the newest good checkpoint is still found.
    two_checkpoints(tmp_path / "pointer")
    (tmp_path / "pointer" / "latest").write_bytes(b"\xff\x00")
    assert load_latest(tmp_path / "pointer")[1]["step"] == 2


def test_pickled_code_is_refused_naming_the_global(tmp_path):
    marker = tmp_path / "marker"
    newest = two_checkpoints(tmp_path)
    newest.write_bytes(pickle.dumps({"w": Evil(marker)}, protocol=2))
    newest.with_suffix(".sha256").unlink()  # no manifest: the loader alone must refuse it
    with pytest.raises(CheckpointError, match=r"refused: it references posix\.system") as e:
        load_file(newest)
    assert_one_clean_line(str(e.value))
    with pytest.warns(UserWarning, match="refused"):
        assert load_latest(tmp_path)[1]["step"] == 1
    assert not marker.exists()


def test_no_good_checkpoint_is_one_error_line(tmp_path):
    assert load_latest(tmp_path) is None  # nothing at all
    for step in (1, 2):
        write_checkpoint(tmp_path, step, {"step": step})
        (tmp_path / f"step-{step:08d}.pt").write_bytes(b"\x80\x02t")
    with pytest.raises(CheckpointError, match="no good checkpoint") as e:
        load_latest(tmp_path)
    assert_one_clean_line(str(e.value))
    assert "step-00000001.pt" in str(e.value) and "step-00000002.pt" in str(e.value)


def test_leftovers_of_a_killed_write_are_removed_by_the_next_save(tmp_path):
    leftovers = ["step-00000003.pt.tmp-4242", "latest.tmp-17", "step-00000003.sha256.tmp-9"]
    for name in leftovers:
        (tmp_path / name).write_bytes(b"partial")
    (tmp_path / "step-00000003.dcp.tmp").mkdir()
    (tmp_path / "step-00000003.dcp.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("mine")
    # a pruning killed after the .pt went: its shards and manifest; and shards of an earlier sharded
    # save of the step written now as a full checkpoint (its manifest would not list them)
    for stale in ("step-00000002.dcp", "step-00000004.dcp"):
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "__0_0.distcp").write_bytes(b"old")
    (tmp_path / "step-00000002.sha256").write_bytes(b"old")
    write_checkpoint(tmp_path, 4, {"step": 4})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "notes.txt", "step-00000004.pt", "step-00000004.sha256"]
    load_latest(tmp_path)  # verifies against its manifest


def test_checkpoint_is_streamed_to_its_file(tmp_path, monkeypatch):
    import paratrain.checkpoint.io as ckpt_io

    targets = []
    real_save = torch.save
    monkeypatch.setattr(ckpt_io.torch, "save", lambda obj, f: (targets.append(f), real_save(obj, f)))
    write_checkpoint(tmp_path, 1, {"w": torch.ones(10)})
    assert len(targets) == 1 and getattr(targets[0], "name", "").endswith(f".tmp-{os.getpid()}")


def test_bit_flip_trial_every_copy_is_detected(tmp_path):
    """50 copies of a checkpoint, each with one random bit flipped: all 50 are caught."""
    rng = random.Random(1234)
    template = tmp_path / "template"
    two_checkpoints(template)
    detected = 0
    for i in range(50):
        d = shutil.copytree(template, tmp_path / f"copy{i}")
        flip_bit(d / "step-00000002.pt", rng)
        with pytest.warns(UserWarning, match="SHA-256"):
            path, _ = load_latest(d)
        detected += path.name == "step-00000001.pt"
    assert detected == 50


def test_resume_with_no_checkpoint_is_an_error(tmp_path):
    cfg = TrainConfig(resume=True, log_dir=None, checkpoint_dir=str(tmp_path / "none"), max_steps=1,
                      progress=False, parallel={"strategy": "single"})
    with pytest.raises(CheckpointError, match="--resume: no checkpoint") as e:
        run_training(cfg)
    assert_one_clean_line(str(e.value))


def test_named_checkpoint_file_is_verified_too(tmp_path):
    pt = paratrain.Parallel(strategy="single", global_batch=4, seed=1)
    model = pt.setup(nn.Linear(3, 2))
    path = pt.save_checkpoint(str(tmp_path), model, None)
    flip_bit(path, random.Random(5))
    with pytest.raises(CheckpointError, match="SHA-256") as e:
        pt.load_checkpoint(str(path), model)
    assert_one_clean_line(str(e.value))
    pt.close()


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    with pytest.raises((pickle.PicklingError, AttributeError)):
        write_checkpoint(tmp_path, 1, {"f": lambda: 0})  # torch.save cannot pickle a lambda
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(200)
def test_cli_resume_with_no_good_checkpoint_fails_in_one_line(tmp_path):
    common = ["train", "--strategy", "single", "--max-steps", "2", "--checkpoint-every", "1", "--no-progress",
              "--log-dir", str(tmp_path)]
    first = run_cli(common, timeout=90)
    assert first.returncode == 0, first.stderr[-3000:]
    for pt_file in (tmp_path / "checkpoints").glob("step-*.pt"):
        pt_file.write_bytes(b"\x80\x02t")
    resumed = run_cli([*common, "--resume"], timeout=90)
    assert resumed.returncode != 0
    lines = [line for line in resumed.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "no good checkpoint" in lines[0] and "Traceback" not in resumed.stderr, resumed.stderr
    assert_one_clean_line(lines[0])
    assert "resumed" not in resumed.stdout and "finished" not in resumed.stdout


# --- sharded checkpoints: fsdp, tensor, pipeline in 2 processes -----------------------------

SHARDED = ("fsdp", "tensor", "pipeline")
OPTIONS = {"pipeline": {"pipeline": {"schedule": "1f1b", "n_microbatches": 2}}}


def small_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 12, generator=g), torch.randint(0, 4, (32,), generator=g))


def _redirect_bytes_entry(dcp_dir: Path, marker: Path) -> None:
    """Point one non-tensor entry (an optimizer ``lr``) of the DCP metadata at a torch.save'd
    pickle that runs code: metadata that is itself well-formed."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from paratrain.checkpoint.safe_dcp import read_metadata

    meta = read_metadata(dcp_dir / ".metadata")
    index = next(i for i in meta.storage_data if i.fqn.startswith("optim.param_groups.") and i.fqn.endswith(".lr"))
    evil = dcp_dir / "evil.distcp"
    torch.save(Evil(marker), evil)
    meta.storage_data[index] = _StorageInfo(relative_path=evil.name, offset=0, length=evil.stat().st_size)
    with open(dcp_dir / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def _sharded_cases(rank: int, strategy: str, root: Path, marker: Path) -> dict:
    """Train 4 steps (checkpoints at 2 and 4), then damage the checkpoints one way after another
    and resume in the same processes; returns each case's outcome on this rank."""
    from paratrain.checkpoint.sharded import load_sharded

    pt = paratrain.Parallel(strategy=strategy, global_batch=8, seed=1, **OPTIONS.get(strategy, {}))
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = pt.setup(model, opt)
    d, backup = root / strategy, root / f"{strategy}.good"
    fit(pt, model, opt, small_data(), epochs=1, max_steps=4, progress_bar=False, checkpoint_dir=str(d),
        checkpoint_every=2)
    if rank == 0:
        shutil.copytree(d, backup)
    newest = d / "step-00000004.dcp"

    def crafted_metadata(dcp_dir=newest):
        with open(dcp_dir / ".metadata", "wb") as f:
            pickle.dump(Evil(marker), f)

    def no_manifest():
        (d / "step-00000004.sha256").unlink()

    def biggest_shard():
        flip_bit(max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size), random.Random(rank))

    cases = {
        "crafted metadata": [crafted_metadata],
        "crafted metadata, no manifest": [crafted_metadata, no_manifest],
        "crafted metadata, load_sharded": [crafted_metadata],
        "crafted entry, no manifest": [lambda: _redirect_bytes_entry(newest, marker), no_manifest],
        "flipped shard bit": [biggest_shard],
        "all crafted": [crafted_metadata, lambda: crafted_metadata(d / "step-00000002.dcp")],
    }
    out = {}
    for case, damages in cases.items():
        if rank == 0:
            shutil.rmtree(d)
            shutil.copytree(backup, d)
            for damage in damages:
                damage()
        dist.barrier()
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if case.endswith("load_sharded"):
                    load_sharded(newest, model, opt)
                    result = ("ok", None)
                else:
                    pt.load_checkpoint(str(d), model, opt)
                    result = ("ok", pt.global_step)
            except CheckpointError as e:
                result = ("error", str(e))
        out[case] = (result, [str(w.message) for w in caught if "older checkpoint" in str(w.message)])
        dist.barrier()
    return out


def sharded_worker(rank, root, marker):
    out = {strategy: _sharded_cases(rank, strategy, Path(root), Path(marker)) for strategy in SHARDED}
    paratrain.destroy()
    return out


@pytest.mark.timeout(300)
def test_crafted_and_damaged_sharded_checkpoints(tmp_path):
    marker = tmp_path / "PWNED"
    outs = paratrain.launch(sharded_worker, nprocs=2, args=(str(tmp_path), str(marker)), timeout=240)
    assert not marker.exists(), "a crafted checkpoint ran code"
    for strategy in SHARDED:
        for rank, out in enumerate(o[strategy] for o in outs):
            where = f"{strategy} rank {rank}"
            # The digest catches the replaced metadata before anything unpickles it: step 2 is used.
            (result, warned) = out["crafted metadata"]
            assert result == ("ok", 2), (where, result)
            if rank == 0:
                assert len(warned) == 1 and ".metadata" in warned[0] and "SHA-256" in warned[0], (where, warned)
            # Without a manifest the restricted unpickler refuses it, naming the global.
            (result, warned) = out["crafted metadata, no manifest"]
            assert result == ("ok", 2), (where, result)
            if rank == 0:
                assert len(warned) == 1 and "refused" in warned[0] and "posix.system" in warned[0], (where, warned)
                assert_one_clean_line(warned[0])
            (kind, message), _ = out["crafted metadata, load_sharded"]
            assert kind == "error" and "refused" in message and "posix.system" in message, (where, message)
            assert_one_clean_line(message)
            # A well-formed metadata whose optimizer entry is a code-running pickle: refused, one line.
            (kind, message), _ = out["crafted entry, no manifest"]
            assert kind == "error" and "refused" in message and "posix.system" in message, (where, message)
            assert_one_clean_line(message)
            (result, warned) = out["flipped shard bit"]
            assert result == ("ok", 2), (where, result)
            if rank == 0:
                assert len(warned) == 1 and ".distcp" in warned[0] and "SHA-256" in warned[0], (where, warned)
            (kind, message), _ = out["all crafted"]
            assert kind == "error" and message.startswith("no good checkpoint"), (where, message)
            assert_one_clean_line(message)
    # Trial: 50 copies of the fsdp checkpoint, each with one random bit flipped in one of the
    # newest checkpoint's files (.pt, DCP metadata, a shard, extra.json, manifest): all caught.
    rng = random.Random(99)
    files = sorted(p for p in (tmp_path / "fsdp.good").rglob("*") if p.is_file() and "00000004" in str(p))
    assert len(files) == 6, files
    detected = 0
    for i in range(50):
        d = shutil.copytree(tmp_path / "fsdp.good", tmp_path / f"trial{i}")
        flip_bit(d / rng.choice(files).relative_to(tmp_path / "fsdp.good"), rng)
        with pytest.warns(UserWarning):
            path, _ = load_latest(d)
        detected += path.name == "step-00000002.pt"
    assert detected == 50

