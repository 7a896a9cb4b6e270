"""Parameter server over torch.distributed.rpc: sync == a plain one-process loop; async applies every update."""

import functools
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
from parity import Problem, assert_same_state, mlp, teacher_data

make_model = functools.partial(mlp, 10, 16, 4)
# 4 steps/epoch: 7 steps cross an epoch boundary. Measured on the float32 reference
# (tests/test_parity_conditioning.py): 1 vs 2 threads and float32 vs float64 <= 2e-7 (so 1e-5, >= 10x).
PROBLEM = Problem(make_model, functools.partial(teacher_data, 64, (10,), seed=123), global_batch=16, steps=7, seed=3,
                  lr=0.05, momentum=0.9, rtol=1e-5)
# momentum SGD, lr halved every 2 steps (StepLR on the workers), the global gradient clipped to norm 0.5
DECAYED = PROBLEM.replace(scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5))
DECAYED_CLIPPED = DECAYED.replace(clip=0.5)
PROBLEMS = {"mlp": PROBLEM, "mlp, StepLR": DECAYED, "mlp, StepLR, clip": DECAYED_CLIPPED}
GLOBAL_BATCH, SEED = PROBLEM.global_batch, PROBLEM.seed


def make_optimizer(params):
    return PROBLEM.optimizer(params)


def loss_that_hangs_on_rank_2(out, y):
    if os.environ["RANK"] == "2":
        time.sleep(600)  # killed by launch once another rank fails
    return nn.functional.cross_entropy(out, y)


def ps_worker(local_rank, mode, steps, fault=None):
    model_fn = (lambda: nn.Linear(3, 4)) if fault == "raise" and local_rank == 1 else make_model
    loss_fn = loss_that_hangs_on_rank_2 if fault == "hang" else nn.functional.cross_entropy
    return run_parameter_server(model_fn, make_optimizer, TensorDataset(*PROBLEM.data()), global_batch=GLOBAL_BATCH,
                                steps=steps, mode=mode, seed=SEED, loss_fn=loss_fn,
                                rpc_timeout_s=4 if fault == "hang" else 30)


def test_sync_matches_single_process_reference():
    steps = PROBLEM.steps
    server, *workers = paratrain.launch(ps_worker, nprocs=3, args=("sync", steps), timeout=60)
    assert server.role == "server" and server.updates == steps
    assert server.staleness_max == 0
    assert [w.updates for w in workers] == [steps, steps]
    assert_same_state(server.state_dict, PROBLEM.reference().state, PROBLEM.rtol)


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
        paratrain.launch(ps_worker, nprocs=3, args=("sync", PROBLEM.steps, "raise"), timeout=60)


@pytest.mark.waits
def test_hanging_worker_times_out_instead_of_hanging():
    # Worker 2 never pushes: worker 1's sync step (or the server's wait) hits rpc_timeout_s, well before launch's limit.
    with pytest.raises(LaunchError, match="rpc_timeout_s=4"):
        paratrain.launch(ps_worker, nprocs=3, args=("sync", PROBLEM.steps, "hang"), timeout=60)


def _run_here(monkeypatch, world, **kwargs):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    defaults = dict(global_batch=GLOBAL_BATCH, steps=PROBLEM.steps)
    run_parameter_server(make_model, make_optimizer, TensorDataset(*PROBLEM.data()), **{**defaults, **kwargs})


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
    loader = pt.train_loader(TensorDataset(*PROBLEM.data()))
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
    p = DECAYED_CLIPPED
    outs = paratrain.launch(parallel_worker, nprocs=2, args=("ps", p.steps, None, False, "sync", p.clip, 0.5), timeout=60)
    ref = p.reference().state
    for out in outs:  # every rank gets the server's parameters
        assert_same_state(out["state"], ref, p.rtol)
        assert out["local_optimizer_state"] == 0  # the server's twin holds the momentum
    assert outs[0]["report"] == {"ps_mode": "sync", "ps_updates": p.steps, "ps_staleness_mean": 0.0,
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
    ref = DECAYED.reference().state
    for strategy, world in (("ps", 2), ("ddp", 2), ("single", 1)):
        again = shutil.copytree(ckpt, tmp_path / strategy)
        outs = paratrain.launch(parallel_worker, nprocs=world,
                                args=(strategy, DECAYED.steps, str(again), True, "sync", None, 0.5), timeout=60)
        for out in outs:
            assert out["resumed_at"] == 4
            assert_same_state(out["state"], ref, DECAYED.rtol)


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
    loader = pt.train_loader(TensorDataset(*PROBLEM.data()))
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
    loader = pt.train_loader(TensorDataset(*PROBLEM.data()))
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


def test_the_server_rebuilds_adamw_whose_defaults_are_not_all_constructor_arguments():
    # torch 2.13's AdamW has a 'decoupled_weight_decay' default that its constructor does not take
    from paratrain.strategies.ps import _server_optimizer

    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    copies = [p.detach().clone().requires_grad_() for p in net.parameters()]
    server = _server_optimizer(opt, copies, {id(p): i for i, p in enumerate(net.parameters())})
    assert type(server) is torch.optim.AdamW and server.param_groups[0]["params"] == copies
    assert server.param_groups[0]["weight_decay"] == 0.1 and server.param_groups[0]["lr"] == 0.01
