"""Checkpoints written in the background (issue 28, item 6): ``pt.save_checkpoint(...,
asynchronous=True)`` returns before the checkpoint is on disk and training goes on; the result
equals blocking saves'; a process killed while a checkpoint is being written leaves the previous
one the newest good checkpoint, and resuming from it ends with the weights of an uninterrupted
run, bit for bit. fsdp (DCP's async_save of each rank's shards) and ddp (rank 0's copy of a plain
state), at world size 2 over gloo."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import paratrain
from paratrain.checkpoint import load_latest, verify_checkpoint
from paratrain.launch.spawn import LaunchError

pytestmark = pytest.mark.timeout(400)
STEPS, EVERY, BATCH, SEED = 6, 2, 8, 11


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 6, generator=g, dtype=torch.float64)
        self.y = self.x @ torch.randn(6, 2, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


DELAY: dict[int, float] = {}  # seconds each write of checkpoint {step: ...} of this process sleeps first


def _slow_writes() -> None:
    """Every DCP and torch.save write of this process sleeps first, as long as ``DELAY`` says for
    the step it writes (read off its path: a write still running when the next save sets its own
    delay keeps its step's)."""
    import re

    import torch.distributed.checkpoint.filesystem as fs

    from paratrain.checkpoint import io

    write_data, save_file = fs.FileSystemWriter.write_data, io.save_file

    def pause(path) -> None:
        found = re.search(r"step-(\d+)", str(path))
        time.sleep(DELAY.get(int(found.group(1)), 0.0) if found else 0.0)

    def slow_write_data(self, *args, **kwargs):
        pause(self.path)
        return write_data(self, *args, **kwargs)

    def slow_save_file(obj, path, *args, **kwargs):
        pause(path)
        return save_file(obj, path, *args, **kwargs)

    fs.FileSystemWriter.write_data = slow_write_data
    io.save_file = slow_save_file


def _worker(rank: int, strategy: str, folder: str, mode: str) -> dict:
    """``mode``: "async" (saves every EVERY steps, each write slowed by 1 s), "kill" (the save at
    step 4 is slowed by 60 s; every rank kills itself at step 5), "resume" (blocking saves, from
    the newest checkpoint) or "plain" (no checkpoints)."""
    pt = paratrain.Parallel(strategy=strategy, global_batch=BATCH, seed=SEED)
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    if mode == "resume":
        pt.load_checkpoint(folder, model, opt)
    else:
        _slow_writes()
    returned, listed = [], []
    for x, y in pt.train_loader(Data()):
        if pt.global_step == STEPS:
            break
        if mode == "kill" and pt.global_step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        pt.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        if mode != "plain" and pt.global_step % EVERY == 0:
            background = mode in ("async", "kill")
            DELAY[pt.global_step] = 60.0 if mode == "kill" and pt.global_step == 4 else 1.0 if background else 0.0
            start = time.monotonic()
            pt.save_checkpoint(folder, model, opt, asynchronous=background)
            returned.append(time.monotonic() - start)
            listed.append(sorted(p.name for p in Path(folder).glob("step-*.pt")))
    state = pt.full_state_dict(model)
    pt.close()  # waits for the last background save
    return {"state": state, "returned": returned, "listed": listed}


def _launch(strategy: str, folder: Path, mode: str) -> dict:
    return paratrain.launch(_worker, nprocs=2, args=(strategy, str(folder), mode), timeout=240)[0]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_background_checkpoints_survive_a_kill_mid_write_and_resume_exactly(strategy: str, tmp_path: Path) -> None:
    plain = _launch(strategy, tmp_path / "none", "plain")["state"]

    done = _launch(strategy, tmp_path / "async", "async")
    # each save returned before its slowed write finished (the new .pt was not there yet); the first
    # returned at once, the others after waiting for the one before
    assert done["returned"][0] < 1.0, done["returned"]
    assert done["listed"] == [[], ["step-00000002.pt"], ["step-00000002.pt", "step-00000004.pt"]]
    assert all(torch.equal(done["state"][k], v) for k, v in plain.items())  # saving changed nothing
    path, saved = load_latest(tmp_path / "async")
    assert path.name == "step-00000006.pt" and saved["global_step"] == 6  # close() waited for the last one
    for step in (2, 4, 6):
        verify_checkpoint(tmp_path / "async" / f"step-{step:08d}.pt")  # manifests and digests as a blocking save's

    with pytest.raises(LaunchError):
        _launch(strategy, tmp_path / "killed", "kill")  # killed while step 4's checkpoint was being written
    path, saved = load_latest(tmp_path / "killed")
    assert path.name == "step-00000002.pt" and saved["global_step"] == 2
    resumed = _launch(strategy, tmp_path / "killed", "resume")["state"]
    assert all(torch.equal(resumed[k], v) for k, v in plain.items())


def test_a_failed_background_write_is_raised_at_the_next_save_and_keeps_the_previous(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    from paratrain.checkpoint import io

    pt = paratrain.Parallel(global_batch=BATCH, seed=SEED)
    model = nn.Linear(6, 2).double()
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    pt.save_checkpoint(str(tmp_path), model, opt, asynchronous=True).result()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io, "save_file", full_disk)
    pt.global_step += 1
    pending = pt.save_checkpoint(str(tmp_path), model, opt, asynchronous=True)  # returns; fails in the thread
    with pytest.raises(OSError, match="No space left"):
        pt.save_checkpoint(str(tmp_path), model, opt, asynchronous=True)  # the next save says so
    assert pending.done() and load_latest(tmp_path)[0].name == "step-00000000.pt"
    monkeypatch.undo()
    pt.close()
