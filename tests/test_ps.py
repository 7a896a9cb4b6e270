"""Parameter server over torch.distributed.rpc: sync == a plain one-process loop; async applies every update."""

import json
import os
import shutil
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


def reference(steps, clip=None, gamma=1.0):
    """Plain PyTorch, one process, the same global batches in paratrain's documented order;
    momentum SGD, a StepLR schedule (gamma 1: constant lr) and optional clipping."""
    x, y = make_data()
    torch.manual_seed(SEED)
    model = make_model()
    opt = make_optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=gamma)
    per_epoch = N // GLOBAL_BATCH
    for s in range(steps):
        epoch, i = divmod(s, per_epoch)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))
        idx = perm[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
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


def assert_close(got, ref, rtol=1e-5):
    assert got.keys() == ref.keys()
    for k in ref:
        err = ((got[k] - ref[k]).norm() / ref[k].norm()).item()
        assert err <= rtol, f"{k}: relative error {err:.2e}"


def parallel_worker(local_rank, strategy, steps, ckpt_dir=None, resume=False, mode="sync", clip=None, gamma=1.0):
    """The user's own loop with Parallel: ps pushes at optimizer.step(); checkpoints every 2 steps."""
    pt = paratrain.Parallel(strategy=strategy, global_batch=GLOBAL_BATCH, seed=SEED, clip_grad_norm=clip,
                            **({"ps": {"mode": mode}} if strategy == "ps" else {}))
    model = make_model()
    opt = make_optimizer(model.parameters())
    model, opt = pt.setup(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=2, gamma=gamma)
    if resume:
        pt.load_checkpoint(ckpt_dir, model, opt, sched)
    resumed_at, losses = pt.global_step, []
    loader = pt.train_loader(TensorDataset(*make_data()))
    while pt.global_step < steps:
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            pt.backward(loss)
            opt.step()
            sched.step()
            losses.append(pt.all_reduce_mean(loss).item())
            if ckpt_dir and not resume and pt.global_step % 2 == 0:
                pt.save_checkpoint(ckpt_dir, model, opt, sched)
            if pt.global_step == steps:
                break
    out = {"state": pt.full_state_dict(model), "report": pt.strategy.report(), "resumed_at": resumed_at,
           "losses": losses, "local_optimizer_state": len(opt.state)}
    pt.close()
    return out


def test_parallel_sync_matches_reference_with_scheduler_and_clipping():
    # ps behind Parallel: both ranks train, rank 0 also serves; lr decays on the workers' scheduler
    # and travels with each push, clipping runs on the server after the mean.
    outs = paratrain.launch(parallel_worker, nprocs=2, args=("ps", STEPS, None, False, "sync", 0.5, 0.5), timeout=60)
    ref = reference(STEPS, clip=0.5, gamma=0.5)
    for out in outs:  # every rank gets the server's parameters
        assert_close(out["state"], ref)
        assert out["local_optimizer_state"] == 0  # the server's twin holds the momentum
    assert outs[0]["report"] == {"ps_mode": "sync", "ps_updates": STEPS, "ps_staleness_mean": 0.0,
                                 "ps_staleness_max": 0}
    assert outs[1]["report"] == {}


def test_parallel_async_applies_every_rank_update():
    steps = 24
    outs = paratrain.launch(parallel_worker, nprocs=2, args=("ps", steps, None, False, "async"), timeout=60)
    report = outs[0]["report"]
    assert report["ps_updates"] == 2 * steps  # ranks x steps, each applied once
    assert 0 <= report["ps_staleness_mean"] <= report["ps_staleness_max"] <= 2 * steps
    losses = outs[0]["losses"]
    assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6, losses


def test_parallel_checkpoint_resumes_on_ps_ddp_and_single(tmp_path):
    # Rank 0 writes the server's parameters and momentum; the checkpoint is an ordinary one, so
    # ps, ddp and a single process all resume from step 4 and end where the reference ends.
    ckpt = tmp_path / "ckpt"
    paratrain.launch(parallel_worker, nprocs=2, args=("ps", 5, str(ckpt), False, "sync", None, 0.5), timeout=60)
    ref = reference(STEPS, gamma=0.5)
    for strategy, world in (("ps", 2), ("ddp", 2), ("single", 1)):
        again = shutil.copytree(ckpt, tmp_path / strategy)
        outs = paratrain.launch(parallel_worker, nprocs=world,
                                args=(strategy, STEPS, str(again), True, "sync", None, 0.5), timeout=60)
        for out in outs:
            assert out["resumed_at"] == 4
            assert_close(out["state"], ref)


def test_fp16_is_refused_with_ps():
    with pytest.raises(ValueError, match="precision fp16-mixed is not supported with strategy ps"):
        paratrain.ParallelConfig(strategy="ps", precision="fp16-mixed")


def test_paratrain_train_strategy_ps(tmp_path):
    """The parameter server from the command line, through Parallel and fit: 2 ranks, rank 0 also serves."""
    from clitools import run_cli

    res = run_cli(["train", "--strategy", "ps", "--nproc-per-node", "2", "--max-steps", "20", "--no-progress",
                   "--log-dir", str(tmp_path), "--set", "parallel.ps.mode=async"], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == 20 and result["ps_updates"] == 40 and result["ps_mode"] == "async"
    assert result["test_count"] == 359 and result["test_accuracy"] > 0.5


def weights_after_setup_worker(local_rank):
    """Weights loaded into the set-up model reach the server: a step with lr 0 keeps them."""
    pt = paratrain.Parallel(strategy="ps", global_batch=GLOBAL_BATCH, seed=SEED)
    model = make_model()
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    torch.manual_seed(99)
    new = make_model().state_dict()
    model.load_state_dict(new)
    loader = pt.train_loader(TensorDataset(*make_data()))
    xb, yb = next(iter(loader))
    pt.backward(nn.functional.cross_entropy(model(xb), yb))
    opt.step()
    state = pt.full_state_dict(model)
    pt.close()
    return all(torch.equal(state[k], new[k]) for k in new)


def test_weights_loaded_after_setup_reach_the_server():
    assert paratrain.launch(weights_after_setup_worker, nprocs=1, timeout=60) == [True]


def server_fails_worker(local_rank):
    """Rank 0 stops after one step (as after an error); rank 1 must hear why, not a broken pipe."""
    pt = paratrain.Parallel(strategy="ps", global_batch=GLOBAL_BATCH, seed=SEED, ps={"rpc_timeout_s": 20})
    model = make_model()
    model, opt = pt.setup(model, make_optimizer(model.parameters()))
    loader = pt.train_loader(TensorDataset(*make_data()))
    try:
        for xb, yb in loader:
            opt.zero_grad()
            pt.backward(nn.functional.cross_entropy(model(xb), yb))
            opt.step()
            if pt.rank == 0:
                pt.close(wait_for_peers=False)
                return "closed"
    except Exception as e:  # noqa: BLE001 - the message is the result
        pt.close(wait_for_peers=False)
        return str(e)
    return "no error"


def test_server_rank_failing_tells_the_others_why():
    closed, heard = paratrain.launch(server_fails_worker, nprocs=2, timeout=60)
    assert closed == "closed"
    assert heard == "parameter server: rank 0 (which hosts the server) stopped after an error"
