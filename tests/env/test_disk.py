"""Disk errors as one line (issue 26, item 3): a full disk, a read-only filesystem or an exceeded
quota in any save names the folder, the bytes needed and free, and says the previous checkpoint is
intact (which it is: it loads). Real filesystems: small tmpfs mounts (root only, else skipped)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from mounts import tmpfs as _tmpfs
from paratrain.checkpoint import io
from paratrain.checkpoint.export import save_model
from paratrain.checkpoint.state import load_checkpoint, save_checkpoint
from paratrain.env.disk import StorageError, check_room, writing
from paratrain.loop.logging import write_atomic
from paratrain.tracking import Trackers

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

FULL = r"the disk is full \(needs about [\d.]+ (bytes|KiB|MiB), [\d.]+ (bytes|KiB|MiB) free\)"


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[int], Any]]:
    """``small_fs(kib)``: a fresh tmpfs of that size (unmounted after the test)."""
    made = iter(range(100))
    with contextlib.ExitStack() as stack:
        yield lambda kib: stack.enter_context(_tmpfs(tmp_path / f"fs{next(made)}", kib))


def _remount_read_only(folder: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)


class _Run:
    """The ``Run`` a checkpoint saves: step, batch, seed, world."""

    rank, world_size = 0, 1

    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.step, "global_batch": 4, "seed": 0, "world_size": 1, "precision": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["global_step"]


class _Whole:
    """A strategy that checkpoints the whole module (ddp, single)."""

    sharded_state = False

    def checkpoint_state(self, module: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return module.state_dict(), optimizer.state_dict()

    def load_checkpoint_state(self, module: nn.Module, optimizer: Any, model_state: dict[str, Any],
                              optim_state: dict[str, Any] | None) -> None:
        module.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)


class _Sharded(_Whole):
    """A strategy that checkpoints through DCP (fsdp, tensor, pipeline)."""

    sharded_state = True


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(100, 200, dtype=torch.float64)  # 160 KiB of weights
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _one_line(e: pytest.ExceptionInfo) -> str:
    line = str(e.value)
    assert "\n" not in line
    return line


@pytest.mark.parametrize("how", [_Whole(), _Sharded()], ids=["file", "dcp"])
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_loads(small_fs: Callable[[int], Path], how: Any,
                                                                   tmp_path: Path) -> None:
    model, opt = _model()
    save_checkpoint(tmp_path / "one", _Run(1), model, opt, how)
    one = sum(-(-p.stat().st_size // 4096) * 4 for p in (tmp_path / "one").rglob("*") if p.is_file())  # KiB in pages
    folder = small_fs(int(2.5 * one))  # room for two checkpoints of this model, not three
    for step in (1, 2):
        save_checkpoint(folder, _Run(step), model, opt, how)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(StorageError) as e:
        save_checkpoint(folder, _Run(3), model, opt, how)
    part = "step-00000003.dcp" if how.sharded_state else "step-00000003.pt"
    assert re.fullmatch(rf"cannot write {part} in '{folder}': {FULL}; the previous checkpoint step-00000002.pt is "
                        r"intact: free space, or choose another checkpoint folder", _one_line(e)), str(e.value)
    assert e.value.errno == errno.ENOSPC
    if how.sharded_state:  # DCP's writer threads say only torch.save's "unexpected pos": the free space tells
        assert "unexpected pos" in str(e.value.__cause__)
    assert sorted(p.name for p in folder.iterdir() if "00000003" in p.name or ".tmp" in p.name) == []  # room back
    run, fresh = _Run(0), _model()
    load_checkpoint(folder, run, fresh[0], fresh[1], how)
    assert run.step == 2 and all(torch.equal(fresh[0].state_dict()[k], v) for k, v in saved.items())


def test_a_file_that_does_not_fit_leaves_nothing_behind(small_fs: Callable[[int], Path]) -> None:
    folder = small_fs(100)
    with pytest.raises(StorageError) as e:
        io.save_file({"w": torch.zeros(50_000)}, folder / "big.pt")  # 195 KiB into 100
    assert re.fullmatch(rf"cannot write big.pt in '{folder}': {FULL}: free space, or choose another checkpoint "
                        "folder", _one_line(e))
    assert not any(folder.iterdir())  # no temporary file left


def test_a_read_only_filesystem_is_one_line_and_the_previous_checkpoint_loads(small_fs: Callable[[int], Path]) -> None:
    folder = small_fs(1024)
    model, opt = _model()
    save_checkpoint(folder, _Run(1), model, opt, _Whole())
    _remount_read_only(folder)
    with pytest.raises(StorageError) as e:
        save_checkpoint(folder, _Run(2), model, opt, _Whole())
    assert re.fullmatch(rf"cannot write step-00000002.pt in '{folder}': the filesystem is read-only \(needs about "
                        r"[\d.]+ KiB, [\d.]+ KiB free\); the previous checkpoint step-00000001.pt is intact: remount it "
                        r"writable, or choose another checkpoint folder", _one_line(e))
    run, fresh = _Run(0), _model()
    load_checkpoint(folder, run, fresh[0], fresh[1], _Whole())
    assert run.step == 1


def test_an_exceeded_quota_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model()
    save_checkpoint(tmp_path, _Run(1), model, opt, _Whole())

    def over_quota(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"partial")
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(io.torch, "save", over_quota)
    with pytest.raises(StorageError) as e:
        save_checkpoint(tmp_path, _Run(2), model, opt, _Whole())
    assert re.fullmatch(rf"cannot write step-00000002.pt in '{tmp_path}': the disk quota is exceeded \(needs about "
                        r"[\d.]+ KiB, [\d.]+ [KMGT]iB free\); the previous checkpoint step-00000001.pt is intact: free "
                        r"space under your quota, or choose another checkpoint folder", _one_line(e))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001.pt", "step-00000001.sha256"]
    with pytest.raises(OSError) as other:  # other errors pass unchanged
        with writing(tmp_path / "x"):
            raise FileNotFoundError(errno.ENOENT, "gone")
    assert type(other.value) is FileNotFoundError


def test_export_logs_and_trackers_on_a_full_disk_are_one_line(small_fs: Callable[[int], Path]) -> None:
    folder = small_fs(64)
    with pytest.raises(StorageError, match=rf"^cannot write model.safetensors in '{folder}': {FULL}; no partial "
                                           "file is left: free space, or choose another export folder$"):
        save_model({"w": torch.zeros(40_000)}, folder)
    assert sorted(p.name for p in folder.iterdir()) == []
    with pytest.raises(StorageError, match=rf"^cannot write result.json in '{folder}': {FULL}: free space, or "
                                           "choose another log_dir$"):
        write_atomic(folder / "result.json", "x" * 100_000)
    trackers = Trackers("csv", str(folder / "run"))
    with open(folder / "filler", "wb", buffering=0) as f:  # fill the disk up to the last byte
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
    with pytest.raises(StorageError, match=rf"^cannot write in '{folder / 'run'}': the disk is full \(.*\): free "
                                           "space, or choose another log_dir$"):
        for step in range(1000):
            trackers.log({"loss": 0.5, "note": "x" * 200}, step)


def test_a_folder_without_room_for_two_checkpoints_is_warned_about(small_fs: Callable[[int], Path]) -> None:
    folder = small_fs(256)
    assert check_room(folder, 100 * 1024, "checkpoints")
    with pytest.warns(UserWarning, match=rf"^'{folder}' has [\d.]+ KiB free, less than 2 checkpoints of about "
                                         r"200.0 KiB each: a save there can fail on a full disk \(the previous one "
                                         r"stays intact\); free space, or choose another folder$"):
        assert not check_room(folder, 200 * 1024, "checkpoints")
