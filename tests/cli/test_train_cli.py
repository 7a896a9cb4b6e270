"""``paratrain train``: the main job end to end, and one-line errors for bad input."""

from __future__ import annotations

import json
import os

import pytest

import zygote
from clitools import run_cli

pytestmark = pytest.mark.timeout(150)


def test_ddp_on_two_processes_trains_digits(tmp_path):
    res = run_cli(["train", "--strategy", "ddp", "--nproc-per-node", "2", "--epochs", "3", "--no-progress",
                   "--log-dir", str(tmp_path), "--tensorboard"], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    # the suite's own machinery: the workers' forkserver forked from the zygote, not a new interpreter
    assert zygote.FORK_FAILED not in res.stderr, res.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2
    assert result["test_count"] == 359  # every test sample counted once
    assert result["test_accuracy"] > 0.85
    assert "test accuracy" in res.stdout and res.stdout.count("finished") == 1  # main process only
    assert (tmp_path / "train.csv").read_text().startswith("step,loss,lr")
    # the same records as TensorBoard scalars, written by the main process only
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tmp_path / "tensorboard").iterdir())
    assert len(events) == 1, events
    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert {"train/loss", "train/samples_per_s", "eval/accuracy"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [22, 44, 66]  # 1438 // 64 steps per epoch


def test_config_file_and_overrides(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text('model = "cnn"\nepochs = 1\nmax_steps = 3\n[parallel]\nglobal_batch = 32\n'
                   '[optim]\nlr = 0.1\nwarmup_steps = 2\nbase_batch = 16\n')
    res = run_cli(["train", "--config", str(cfg), "--set", "parallel.accumulation=2", "--no-progress",
                   "--log-dir", str(tmp_path / "out")], timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["steps"] == 3
    assert result["config"]["model"] == "cnn" and result["config"]["parallel"]["accumulation"] == 2
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert lrs[-1] == pytest.approx(0.2)  # linear scaling: 0.1 x 32/16, warmup done (default rel 1e-6: float arithmetic)
    # what produced the run is recorded, and its config.toml re-runs it
    prov = result["provenance"]
    assert prov["command"].startswith("paratrain train --config") and prov["torch"] and prov["python"]
    assert prov["world"]["world_size"] == 1 and prov["devices"] and prov["host"]
    again = run_cli(["train", "--config", str(tmp_path / "out" / "config.toml"), "--print-config"], timeout=60)
    assert again.returncode == 0 and (tmp_path / "out" / "config.toml").read_text() == again.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--strategy", "ddp", "--nproc-per-node", "3", "--global-batch", "64"], "global batch 64 is not divisible by world size 3"),
        (["--global-batch", "4", "--dataset", "synthetic", "--set", "data.synthetic_size=2"], "fewer than one global batch"),
        (["--strategy", "ddp", "--nproc-per-node", "4", "--global-batch", "4", "--dataset", "synthetic",
          "--set", "data.synthetic_size=3"], "fewer than one global batch"),
        (["--strategy", "zero"], "strategy 'zero' is unknown"),
        (["--precision", "fp7"], "precision 'fp7' is unknown"),
        (["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"], "/nonexistent/cifar"),
        (["--dataset", "cifar10"], "needs --data-dir"),
        (["--strategy", "dp", "--nproc-per-node", "2"], "runs in one process"),
        (["--set", "parallel.nope=1"], "unknown key 'nope'"),
        (["--config", "/nonexistent.toml"], "/nonexistent.toml"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args, needle):
    res = run_cli(["train", "--no-progress", "--log-dir", "none", *args], timeout=60)
    assert res.returncode != 0
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert needle in lines[0], lines[0]


def test_users_own_model_and_dataset(tmp_path):
    res = run_cli(["train", "--model", "tests/scripts/user_task.py:make_net", "--dataset",
                   "tests/scripts/user_task.py:make_data", "--epochs", "3", "--global-batch", "32", "--lr", "0.1",
                   "--no-progress", "--log-dir", str(tmp_path)], timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["test_count"] == 64 and result["test_accuracy"] > 0.8


NETLIB = """
import torch
from torch import nn


class DictNet(nn.Module):  # returns a dict, as many user models do
    def __init__(self, features, classes):
        super().__init__()
        self.fc = nn.Linear(features, classes)

    def forward(self, x):
        return {"logits": self.fc(x)}
"""
TASK = """
import os

import torch
from torch.utils.data import TensorDataset

from netlib import DictNet  # a neighbour of this file


def make_net(input_shape, num_classes):
    return DictNet(input_shape[0], num_classes)


def make_data(train, data_dir=None):
    if data_dir is None:
        raise ValueError("make_data needs data_dir")
    g = torch.Generator().manual_seed(int(open(os.path.join(data_dir, "seed.txt")).read()) + (0 if train else 1))
    x = torch.randn(256 if train else 64, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())
"""


def test_users_files_import_their_neighbours_get_data_dir_and_may_return_dicts(tmp_path):
    (tmp_path / "netlib.py").write_text(NETLIB)
    (tmp_path / "task.py").write_text(TASK)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "seed.txt").write_text("3")
    res = run_cli(["train", "--model", "task.py:make_net", "--dataset", "task.py:make_data", "--data-dir",
                   str(tmp_path / "data"), "--epochs", "3", "--global-batch", "32", "--lr", "0.1", "--no-progress",
                   "--log-dir", str(tmp_path / "run")], timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["test_count"] == 64 and result["test_accuracy"] > 0.8
    res = run_cli(["train", "--model", "netlib.py:DictNet", "--dataset", "task.py:make_data", "--data-dir",
                   str(tmp_path / "data"), "--no-progress", "--log-dir", "none"], timeout=60, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1, res.stderr
    assert "paratrain calls it as DictNet(input_shape=..., num_classes=...)" in lines[0]


SLURM_STEP = dict(SLURM_STEP_ID="0", SLURM_NNODES="2", SLURM_NODELIST="node[01-02]", SLURM_JOB_ID="4242")


def _role_under(monkeypatch, env, launch):
    from paratrain.cli.train import _role

    for k in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI_")) or k in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return _role(launch)


def test_srun_tasks_are_workers_unless_one_per_node_starts_its_own(monkeypatch):
    """`srun -n 2 paratrain train`: each task is a worker. `srun -N 2 --ntasks-per-node 1 paratrain
    train --nproc-per-node 4`: each task is its node's launcher (as torchrun under srun), 2 nodes,
    static rendezvous at the first node, node rank = the task's rank; the run is named after the job.
    Several tasks per node each starting workers is a one-line error."""
    from paratrain.launch.torchrun import LaunchConfig

    two_tasks = dict(SLURM_STEP, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_TASKS_PER_NODE="2")
    assert _role_under(monkeypatch, two_tasks, LaunchConfig())[0] is True
    one_per_node = dict(SLURM_STEP, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_NODEID="1", SLURM_TASKS_PER_NODE="1(x2)")
    worker, launch, per_node = _role_under(monkeypatch, one_per_node, LaunchConfig(nproc_per_node=4))
    assert (worker, per_node) == (False, True)
    assert (launch.nproc_per_node, launch.nnodes, launch.node_rank, launch.master_addr, launch.master_port) == (
        4, "2", 1, "node01", 15000 + 4242)
    given = LaunchConfig(nproc_per_node=4, nnodes="2", rdzv_endpoint="node01:29400")
    assert _role_under(monkeypatch, one_per_node, given)[1] == given  # the user's rendezvous is kept
    static = _role_under(monkeypatch, one_per_node, LaunchConfig(nproc_per_node=4, master_addr="10.0.0.1"))[1]
    assert (static.master_addr, static.node_rank, static.nnodes) == ("10.0.0.1", 1, "2")  # its task's node rank
    mpi = dict(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="0",
               OMPI_COMM_WORLD_LOCAL_SIZE="1")
    with pytest.raises(ValueError, match="mpi gives no address of the first node .* give --master-addr"):
        _role_under(monkeypatch, mpi, LaunchConfig(nproc_per_node=4))
    with pytest.raises(ValueError, match="slurm started 2 tasks on this node.*srun --ntasks-per-node 1"):
        _role_under(monkeypatch, two_tasks, LaunchConfig(nproc_per_node=4))
    # the sbatch script itself (no step id) starts the job: not a worker
    batch = {k: v for k, v in two_tasks.items() if k != "SLURM_STEP_ID"}
    assert _role_under(monkeypatch, batch, LaunchConfig(nproc_per_node=2)) == (False, LaunchConfig(nproc_per_node=2), False)


def test_the_batch_plan_is_made_once_and_the_launcher_counts_digits_without_building_them(monkeypatch, tmp_path):
    """Issue 25: ``paratrain train`` in one process derives the batch plan once (the launcher's check
    hands it to the job) and checks that the data fills a global batch without building the data;
    the job builds its training and test sets once each."""
    import paratrain.config
    from paratrain.cli.main import main
    from paratrain.data.sampler import BatchPlan

    derived, built = [], []
    derive = BatchPlan.derive.__func__
    monkeypatch.setattr(BatchPlan, "derive", classmethod(lambda cls, *a, **k: derived.append(a) or derive(cls, *a, **k)))
    build = paratrain.config.train.build_dataset
    monkeypatch.setattr(paratrain.config.train, "build_dataset", lambda name, train, *a: built.append(train) or build(name, train, *a))
    assert main(["train", "--max-steps", "2", "--no-progress", "--log-dir", str(tmp_path / "run")]) == 0
    assert len(derived) == 1 and built == [True, False]
