"""Exact resume: stop mid-epoch, resume (also on another world size) == uninterrupted; checkpoint
files are atomic and never execute pickled code; a SIGKILLed worker is survived."""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.checkpoint import CheckpointError, list_checkpoints, load_file, load_latest, write_checkpoint
from paratrain.loop import fit, warmup_linear_scaling
from clitools import cli_env, run_cli
from parity import Problem, assert_same_state, teacher_data

N, GLOBAL_BATCH, EPOCHS = 120, 24, 3  # 5 steps per epoch, 15 in all; stop at 7 = mid-epoch 2


def make_model(dropout=False):
    layers = [nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Tanh()]  # smooth: see parity.mlp
    layers += [nn.Dropout(0.3)] if dropout else []
    return nn.Sequential(*layers, nn.Linear(16, 3))


# What train() trains, as a parity problem: tests/test_parity_conditioning.py measures its float32
# reference with 1 vs 2 threads and against float64 (<= 2.1e-7), so the 1e-5 of a resume on another
# world size (the ranks sum gradients in another order) is >= 10x the rounding it can amplify.
PROBLEM = Problem(make_model, functools.partial(teacher_data, N, (10,), classes=3, seed=0), global_batch=GLOBAL_BATCH,
                  steps=EPOCHS * N // GLOBAL_BATCH, seed=1, lr=0.05, momentum=0.5, rtol=1e-5,
                  scheduler=functools.partial(warmup_linear_scaling, global_batch=GLOBAL_BATCH, base_batch=12,
                                              warmup_steps=4))
PROBLEMS = {"mlp with BatchNorm, warmup": PROBLEM}


def data():
    return TensorDataset(*PROBLEM.data())


def train(local_rank, strategy, ckpt_dir, max_steps, resume, dropout):
    pt = paratrain.Parallel(strategy=strategy, global_batch=GLOBAL_BATCH, seed=PROBLEM.seed, sync_batchnorm=True)
    model = make_model(dropout)
    opt = PROBLEM.optimizer(model.parameters())
    sched = PROBLEM.scheduler(opt)
    model, opt = pt.setup(model, opt)
    if resume:
        assert pt.load_checkpoint(ckpt_dir, model, opt, sched) is not None
    fit(pt, model, opt, data(), epochs=EPOCHS, max_steps=max_steps, scheduler=sched, progress_bar=False,
        checkpoint_dir=ckpt_dir, checkpoint_every=3)
    state = pt.full_state_dict(model)
    pt.close()
    return pt.global_step, state


@pytest.mark.parametrize("strategy, world", [("single", 1), ("ddp", 2), ("fsdp", 2)])
def test_stop_mid_epoch_and_resume_is_exact(tmp_path, strategy, world):
    full = paratrain.launch(train, world, (strategy, str(tmp_path / "a"), None, False, True), timeout=90)[0]
    first = paratrain.launch(train, world, (strategy, str(tmp_path / "b"), 7, False, True), timeout=90)[0]
    assert first[0] == 7
    resumed = paratrain.launch(train, world, (strategy, str(tmp_path / "b"), None, True, True), timeout=90)[0]
    assert resumed[0] == full[0] == EPOCHS * N // GLOBAL_BATCH
    # the same world size repeats the same arithmetic: only what the checkpoint holds may differ,
    # and it holds every bit (1e-6 leaves room for nothing else); dropout too: RNG states are restored per rank
    assert_same_state(resumed[1], full[1], rtol=1e-6)


@pytest.mark.parametrize("new_world", [1, 4])
def test_resume_on_a_different_world_size(tmp_path, new_world):
    full = paratrain.launch(train, 2, ("ddp", str(tmp_path / "a"), None, False, False), timeout=90)[0]
    paratrain.launch(train, 2, ("ddp", str(tmp_path / "b"), 7, False, False), timeout=90)
    resumed = paratrain.launch(train, new_world, ("ddp", str(tmp_path / "b"), None, True, False), timeout=120)[0]
    assert_same_state(resumed[1], full[1], rtol=PROBLEM.rtol)  # another world size: see PROBLEM


# --- files ---------------------------------------------------------------------------------

_WRITER = """
import sys, torch
from paratrain.checkpoint import write_checkpoint
write_checkpoint(sys.argv[1], int(sys.argv[2]), {"w": torch.arange(100000.0), "step": int(sys.argv[2])})
"""


def test_killed_writer_leaves_previous_checkpoint(tmp_path):
    subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path), "1"], env=cli_env(), check=True, timeout=60)
    env = cli_env(PARATRAIN_TEST_CRASH_AFTER_BYTES="5000")  # tests/faults: the writer dies after 5000 bytes
    died = subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path), "2"], env=env, timeout=60)
    assert died.returncode != 0  # the writer really died mid-write
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001.pt"]
    assert (tmp_path / "latest").read_text() == "step-00000001.pt"
    path, state = load_latest(tmp_path)
    assert path.name == "step-00000001.pt" and state["step"] == 1
    assert any(p.name.startswith("step-00000002.pt.tmp") for p in tmp_path.iterdir())  # partial, never loaded


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickled_code_is_refused_and_truncated_is_reported(tmp_path):
    write_checkpoint(tmp_path, 1, {"w": torch.ones(3)})
    evil = tmp_path / "step-00000002.pt"
    with open(evil, "wb") as f:
        pickle.dump({"w": _Evil()}, f)
    (tmp_path / "latest").write_text(evil.name)
    with pytest.raises(CheckpointError, match="refused"):
        load_file(evil)
    with pytest.warns(UserWarning, match="refused"):
        path, state = load_latest(tmp_path)  # falls back to the good one
    assert path.name == "step-00000001.pt"

    good = write_checkpoint(tmp_path / "t", 3, {"w": torch.arange(10000.0)})
    good.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        load_file(good)
    assert "\n" not in str(e.value)


def test_keep_last_k(tmp_path):
    for step in range(1, 6):
        write_checkpoint(tmp_path, step, {"s": step}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004.pt", "step-00000005.pt"]


# --- a killed worker under torchrun's elastic agent ----------------------------------------

def _final_params(ckpt_dir):
    path, state = load_latest(ckpt_dir)
    return state["global_step"], state["model"]


@pytest.mark.timeout(240)
def test_sigkilled_worker_is_restarted_and_resumes_exactly(tmp_path):
    common = ["train", "--strategy", "ddp", "--nproc-per-node", "2", "--model", "cnn", "--epochs", "1",
              "--max-steps", "16", "--checkpoint-every", "4", "--no-progress", "--global-batch", "32"]
    ref = run_cli([*common, "--log-dir", str(tmp_path / "ref")], timeout=100)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = run_cli([*common, "--log-dir", str(tmp_path / "kill"), "--max-restarts", "2"], timeout=120,
                     PARATRAIN_TEST_KILL_AT="1:10")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "resumed from step 8" in killed.stdout  # restarted group picked up the last checkpoint
    step_a, ref_params = _final_params(tmp_path / "ref" / "checkpoints")
    step_b, got = _final_params(tmp_path / "kill" / "checkpoints")
    assert step_a == step_b == 16
    assert_same_state(got, ref_params, rtol=1e-6)  # same world size, same arithmetic: equal up to what is saved
    assert json.loads((tmp_path / "kill" / "result.json").read_text())["resumed_from_step"] == 8
    # killed before the first checkpoint: the restarted group starts over from step 0
    early = run_cli([*common, "--log-dir", str(tmp_path / "early"), "--max-restarts", "1"], timeout=120,
                    PARATRAIN_TEST_KILL_AT="0:1")
    assert early.returncode == 0, early.stderr[-3000:]
    assert "no checkpoint" in early.stdout
    assert_same_state(_final_params(tmp_path / "early" / "checkpoints")[1], ref_params, rtol=1e-6)  # as above


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy, kill", [("ps", "0:5"), ("pipeline", "1:5")])  # ps: rank 0 hosts the server
def test_killed_rank_of_ps_and_pipeline_resumes_exactly(tmp_path, strategy, kill):
    common = ["train", "--strategy", strategy, "--nproc-per-node", "2", "--max-steps", "12", "--checkpoint-every",
              "3", "--no-progress"]
    ref = run_cli([*common, "--log-dir", str(tmp_path / "ref")], timeout=100)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = run_cli([*common, "--log-dir", str(tmp_path / "kill"), "--max-restarts", "1"], timeout=120,
                     PARATRAIN_TEST_KILL_AT=kill)
    assert killed.returncode == 0, killed.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "result.json").read_text()) for d in ("ref", "kill"))
    assert b["resumed_from_step"] == 3 and a["steps"] == b["steps"] == 12
    assert b["test_loss"] == a["test_loss"]  # the same final model, evaluated on all 359 test samples


def test_a_rank_that_did_not_exist_joins_the_common_random_streams():
    """Scaling up from 2 to 4 ranks: ranks 2 and 3 get the streams ranks 0 and 1 shared (dropout
    masks stay equal across a tensor-parallel group); only different streams give new ones."""
    import random
    from types import SimpleNamespace

    import numpy as np

    from paratrain.checkpoint.rng import rng_state, same_rng_state
    from paratrain.checkpoint.state import restore_rng

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    common = rng_state()
    run = SimpleNamespace(rank=3, world_size=4, state_dict=lambda: {"seed": 0, "global_step": 7})
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    restore_rng([common, common], run)
    assert same_rng_state(rng_state(), common)
    torch.manual_seed(9)
    other = rng_state()
    restore_rng([common, other], run)
    mine = rng_state()
    assert not same_rng_state(mine["torch"], common["torch"]) and not same_rng_state(mine["python"], common["python"])


def test_a_fresh_run_refuses_a_checkpoint_dir_that_holds_another_runs_checkpoints(tmp_path):
    """Its checkpoints would survive pruning, and a restart of the new run would resume them."""
    from paratrain.checkpoint import CheckpointError
    from paratrain.config import TrainConfig
    from paratrain.loop.train import run_training

    cfg = TrainConfig.load(None, {"model": "mlp", "max_steps": 1, "checkpoint_every": 1,
                                  "checkpoint_dir": str(tmp_path / "ck"), "log_dir": None})
    run_training(cfg)
    with pytest.raises(CheckpointError, match="already holds another run's checkpoints .step-00000001.pt.: continue "
                                              "that run with --resume, or choose another --checkpoint-dir"):
        run_training(cfg)
    assert run_training(cfg.with_overrides({"resume": True}))["steps"] == 1  # --resume continues it


def _load_where_rank_1_cannot_read(rank, directory):
    import paratrain.checkpoint.state as state

    pt = paratrain.Parallel(strategy="ddp", global_batch=4, timeout_s=60)
    model, opt = pt.setup(net := nn.Linear(2, 2), torch.optim.SGD(net.parameters(), lr=0.1))
    pt.save_checkpoint(directory, model, opt)
    if pt.rank == 1:  # e.g. a node whose mount of the checkpoint folder is missing
        state.load_file = lambda path: (_ for _ in ()).throw(FileNotFoundError(f"no such file {path}"))
    try:
        pt.load_checkpoint(directory, model, opt)
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        pt.close(wait_for_peers=False)
    return None


def test_a_rank_that_cannot_read_the_checkpoint_fails_every_rank_at_once(tmp_path):
    """Rank 0 verifies the file; a rank that then cannot read it once left the others waiting in the
    next collective until the timeout."""
    out = paratrain.launch(_load_where_rank_1_cannot_read, 2, (str(tmp_path),), timeout=50)
    assert out[1][0] == "FileNotFoundError"
    assert out[0][0] == "CheckpointError" and out[0][1].startswith("rank 1 could not read checkpoint") \
        and "FileNotFoundError: no such file" in out[0][1], out


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """The steps the interrupted run logged after its last checkpoint were logged twice."""
    import csv

    from paratrain.config import TrainConfig
    from paratrain.loop.train import run_training

    cfg = TrainConfig.load(None, {"model": "mlp", "max_steps": 6, "checkpoint_every": 4, "log_every": 1,
                                  "log_dir": str(tmp_path / "run"), "checkpoint_dir": str(tmp_path / "run" / "ck")})
    run_training(cfg)
    for p in (tmp_path / "run" / "ck").glob("step-00000006.*"):  # killed after logging step 6, before its checkpoint
        p.unlink()
    (tmp_path / "run" / "ck" / "latest").write_text("step-00000004.pt")
    run_training(cfg.with_overrides({"resume": True}))
    with open(tmp_path / "run" / "train.csv", newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f)]
    assert steps == [1, 2, 3, 4, 5, 6]
    lines = (tmp_path / "run" / "train.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]


def test_numpy_numbers_are_logged():
    import numpy as np

    from paratrain.tracking import CSVTracker

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tracker = CSVTracker(d)
        tracker.log_metrics({"f1": np.float32(0.5), "n": np.int64(3), "hist": torch.ones(2)}, 1, "eval")
        assert json.loads(open(os.path.join(d, "eval.jsonl")).read()) == {"step": 1, "f1": 0.5, "n": 3, "hist": [1.0, 1.0]}


def test_a_resume_with_another_seed_is_refused(tmp_path):
    """The rest of the epoch would be another permutation: some samples twice, others never."""
    pt = paratrain.Parallel(global_batch=4, seed=1)
    model, opt = pt.setup(net := nn.Linear(2, 2), torch.optim.SGD(net.parameters(), lr=0.1))
    pt.save_checkpoint(str(tmp_path), model, opt)
    pt.close()
    pt = paratrain.Parallel(global_batch=4, seed=2)
    model, opt = pt.setup(net := nn.Linear(2, 2), torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="was written with seed 1, this run uses 2: resume with the same seed"):
        pt.load_checkpoint(str(tmp_path), model, opt)
    pt.close()


def test_rank0_reads_the_checkpoint_it_resumes_from_once(tmp_path, monkeypatch):
    """Issue 25: choosing the newest good checkpoint reads it; loading it read it again, and a
    checkpoint of another model a third time (to say why). One read per resume, also on that path."""
    from paratrain.checkpoint import CheckpointError
    from paratrain.config import TrainConfig
    from paratrain.loop.train import run_training

    cfg = TrainConfig.load(None, {"model": "mlp", "max_steps": 2, "checkpoint_every": 1,
                                  "checkpoint_dir": str(tmp_path / "ck"), "log_dir": None, "progress": False})
    run_training(cfg)
    reads: list[str] = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: reads.append(str(f)) or load(f, *a, **k))
    assert run_training(cfg.with_overrides({"resume": True, "max_steps": 3}))["resumed_from_step"] == 2
    assert reads == [str(tmp_path / "ck" / "step-00000002.pt")]
    reads.clear()
    with pytest.raises(CheckpointError, match="were written with --model mlp, this run has --model cnn"):
        run_training(cfg.with_overrides({"resume": True, "model": "cnn"}))
    assert reads == [str(tmp_path / "ck" / "step-00000003.pt")]
