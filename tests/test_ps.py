"""Parameter server over torch.distributed.rpc: sync == a plain one-process loop; async applies every update."""

import json
import os
import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.launch.spawn import LaunchError
from paratrain.strategies.ps import PSOptions, run_parameter_server

N, GLOBAL_BATCH, STEPS, SEED, LR = 64, 16, 7, 3, 0.05  # 4 steps/epoch: 7 steps cross an epoch boundary


def make_data():
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, 10, generator=g)
    y = (x[:, :4].argmax(1)).long()  # learnable: the largest of the first four features
    return x, y


def make_model():
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))


def make_optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reference(steps):
    """Plain PyTorch, one process, the same global batches in paratrain's documented order."""
    x, y = make_data()
    torch.manual_seed(SEED)
    model = make_model()
    opt = make_optimizer(model.parameters())
    per_epoch = N // GLOBAL_BATCH
    for s in range(steps):
        epoch, i = divmod(s, per_epoch)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
        idx = perm[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def loss_that_hangs_on_rank_2(out, y):
    if os.environ["RANK"] == "2":
        time.sleep(600)  # killed by launch once another rank fails
    return nn.functional.cross_entropy(out, y)


def ps_worker(local_rank, mode, steps, fault=None):
    model_fn = (lambda: nn.Linear(3, 4)) if fault == "raise" and local_rank == 1 else make_model
    loss_fn = loss_that_hangs_on_rank_2 if fault == "hang" else nn.functional.cross_entropy
    return run_parameter_server(model_fn, make_optimizer, TensorDataset(*make_data()), global_batch=GLOBAL_BATCH,
                                steps=steps, mode=mode, seed=SEED, loss_fn=loss_fn,
                                rpc_timeout_s=4 if fault == "hang" else 30)


def test_sync_matches_single_process_reference():
    server, *workers = paratrain.launch(ps_worker, nprocs=3, args=("sync", STEPS), timeout=60)
    assert server.role == "server" and server.updates == STEPS
    assert server.staleness_max == 0
    assert [w.updates for w in workers] == [STEPS, STEPS]
    ref = reference(STEPS)
    assert server.state_dict.keys() == ref.keys()
    for k in ref:
        err = ((server.state_dict[k] - ref[k]).norm() / ref[k].norm()).item()
        assert err <= 1e-5, f"{k}: relative error {err:.2e}"


def test_async_applies_every_update_and_reports_staleness():
    steps = 30
    server, *workers = paratrain.launch(ps_worker, nprocs=3, args=("async", steps), timeout=60)
    assert server.updates == 2 * steps  # workers x steps, each applied once
    assert len(server.losses) == 2 * steps
    assert 0 <= server.staleness_mean <= server.staleness_max <= 2 * steps
    first, last = sum(server.losses[:10]) / 10, sum(server.losses[-10:]) / 10
    assert last < first, f"async loss did not decrease: {first:.3f} -> {last:.3f}"
    assert all(w.updates == steps and len(w.losses) == steps for w in workers)


def test_failing_worker_fails_the_job_with_its_rank():
    with pytest.raises(LaunchError, match="rank 1 failed: RuntimeError: The size of tensor"):
        paratrain.launch(ps_worker, nprocs=3, args=("sync", STEPS, "raise"), timeout=60)


def test_hanging_worker_times_out_instead_of_hanging():
    # Worker 2 never pushes: worker 1's sync step (or the server's wait) hits rpc_timeout_s, well before launch's limit.
    with pytest.raises(LaunchError, match="rpc_timeout_s=4"):
        paratrain.launch(ps_worker, nprocs=3, args=("sync", STEPS, "hang"), timeout=60)


def _run_here(monkeypatch, world, **kwargs):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    defaults = dict(global_batch=GLOBAL_BATCH, steps=STEPS)
    run_parameter_server(make_model, make_optimizer, TensorDataset(*make_data()), **{**defaults, **kwargs})


@pytest.mark.parametrize("world, kwargs, message", [
    (1, {}, "at least 2 processes"),
    (3, {"mode": "bogus"}, "ps mode 'bogus' is unknown"),
    (3, {"global_batch": 15}, "global batch 15 is not divisible"),
    (3, {"steps": 0}, "steps 0 must be at least 1"),
])
def test_bad_input_is_one_line(monkeypatch, world, kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        _run_here(monkeypatch, world, **kwargs)
    assert "\n" not in str(e.value)


def test_options_validate():
    with pytest.raises(ValueError, match="rpc_timeout_s"):
        PSOptions(rpc_timeout_s=0)
    assert PSOptions(mode="ASYNC").mode == "async"


def test_paratrain_train_strategy_ps(tmp_path):
    """The parameter server from the command line: 1 server + 2 workers on the digits task."""
    from clitools import run_cli

    res = run_cli(["train", "--strategy", "ps", "--nproc-per-node", "3", "--max-steps", "20", "--no-progress",
                   "--log-dir", str(tmp_path)], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["updates"] == 20 and result["test_count"] == 359 and result["test_accuracy"] > 0.5
