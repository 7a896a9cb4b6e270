"""``paratrain run``: real torchrun agents and gloo workers on this machine.

Every CLI call runs in its own session (process group) with a hard time limit; past it the whole
group (agent and workers) is killed with SIGKILL, so a hung collective cannot hang the test run.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

import clitools
from clitools import finish
from pace import scaled
from paratrain.launch.spawn import free_port
from paratrain.launch.torchrun import LaunchConfig, _torchrun_argv

SCRIPTS = "tests/scripts"

pytestmark = pytest.mark.timeout(90)  # backstop; run_cli's own limits are shorter


def start_cli(args: list[str]) -> subprocess.Popen:
    """Start ``python -m paratrain run ARGS`` in a new process group (see clitools)."""
    return clitools.start_cli(["run", *args])


def run_cli(args: list[str], timeout: float = 40) -> subprocess.CompletedProcess:
    return finish(start_cli(args), timeout)


def test_two_workers_allreduce_and_ddp(tmp_path: Path) -> None:
    r = run_cli(["--nproc-per-node", "2", f"{SCRIPTS}/allreduce.py", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["world_size"] == 2
    assert res["sum"] == 0 + 1
    assert res["params_equal"]  # DDP kept the replicas identical
    assert [w["rank"] for w in res["ranks"]] == [0, 1]


def test_two_nodes_static_rendezvous(tmp_path: Path) -> None:
    port = free_port()
    common = ["--nnodes", "2", "--nproc_per_node", "1", "--master-addr", "127.0.0.1", "--master_port", str(port)]
    script = [f"{SCRIPTS}/allreduce.py", str(tmp_path)]
    procs = [start_cli([*common, "--node-rank", str(k), *script]) for k in (0, 1)]
    deadline = time.monotonic() + 40
    results = [finish(p, max(1.0, deadline - time.monotonic())) for p in procs]
    for k, r in enumerate(results):
        assert r.returncode == 0, f"node {k}: {r.stderr[-4000:]}"
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["world_size"] == 2
    assert [(w["rank"], w["node_rank"], w["local_rank"]) for w in res["ranks"]] == [(0, 0, 0), (1, 1, 0)]
    for w in res["ranks"]:  # seed 001: rank = node_rank * nproc_per_node + local_rank
        assert w["rank"] == w["node_rank"] * w["local_world_size"] + w["local_rank"]


def test_worker_failure_names_rank_and_exits_nonzero() -> None:
    t0 = time.monotonic()
    r = run_cli(["--nproc-per-node", "2", f"{SCRIPTS}/fail_rank1.py"], timeout=40)
    assert r.returncode != 0
    assert time.monotonic() - t0 < scaled(40)
    summary = [ln for ln in r.stderr.splitlines() if ln.startswith("paratrain run: error:")]
    assert len(summary) == 1, r.stderr[-4000:]
    assert "rank 1" in summary[0] and "boom rank 1" in summary[0]


def test_max_restarts_recovers(tmp_path: Path) -> None:
    r = run_cli(["--nproc-per-node", "2", "--max-restarts", "1", f"{SCRIPTS}/fail_once.py", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["restart_count"] == 1 and res["world_size"] == 2 and res["sum"] == 1


def test_missing_script_is_a_one_line_usage_error() -> None:
    r = run_cli(["--nproc-per-node", "2", "no/such/script.py"], timeout=30)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no/such/script.py" in lines[0], r.stderr


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        ({"nproc_per_node": 0}, "nproc_per_node=0"),
        ({"nnodes": "2:1"}, "nnodes='2:1'"),
        ({"nnodes": "x"}, "nnodes='x'"),
        ({"nnodes": "2"}, "nnodes=2 needs"),
        ({"nnodes": "2", "master_addr": "h", "node_rank": 2}, "node_rank=2"),
        ({"master_port": 70000}, "master_port=70000"),
        ({"rdzv_endpoint": "h:1", "master_addr": "h"}, "rdzv_endpoint='h:1'"),
        ({"max_restarts": -1}, "max_restarts=-1"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, bad: str) -> None:
    with pytest.raises(ValueError, match=bad.replace("(", r"\(")):
        LaunchConfig(**kwargs)


def test_argv_single_node_binds_loopback() -> None:
    argv = _torchrun_argv(LaunchConfig(nproc_per_node=2), ["t.py", "--lr", "1"], False, {"--local-addr"})
    assert "--rdzv-backend=c10d" in argv and "--local-addr=127.0.0.1" in argv
    assert any(a.startswith("--rdzv-endpoint=127.0.0.1:") for a in argv)  # without a folder for a FileStore
    in_file = _torchrun_argv(LaunchConfig(nproc_per_node=2), ["t.py"], False, {"--local-addr"}, store_dir="/d")
    assert "--rdzv-endpoint=/d/rendezvous" in in_file and "--rdzv-conf=store_type=file" in in_file
    assert any(a.startswith("--rdzv-id=paratrain-") for a in argv)
    assert argv[-3:] == ["t.py", "--lr", "1"]
    multi = _torchrun_argv(LaunchConfig(nnodes="2", master_addr="10.0.0.1", master_port=29500), ["t.py"], True, set())
    assert "--master-addr=10.0.0.1" in multi and "--master-port=29500" in multi
    assert not any(a.startswith(("--rdzv", "--local-addr")) for a in multi) and "--module" in multi


def test_torchrun_flags_pass_through_to_torchrun() -> None:
    """torchrun's own flags reach its parser unchanged; a --rdzv-conf is merged into the private
    file store's conf of a single-node job instead of replacing it."""
    import argparse

    import torch.distributed.run as trun

    from paratrain.cli.run import add_launch_arguments, launch_config

    p = argparse.ArgumentParser()
    add_launch_arguments(p, program=True)
    args = p.parse_args(["--standalone", "--nproc-per-node", "cpu", "--tee", "3", "-r", "1",
                         "--local-ranks-filter", "0", "--start-method", "fork", "--rdzv-conf", "join_timeout=60",
                         "--no-python"])
    cfg = launch_config(args)
    assert cfg.nproc_per_node >= 1 and cfg.standalone
    argv = _torchrun_argv(cfg, ["prog"], False, set(trun.get_args_parser()._option_string_actions), "/tmp/x")
    ns = trun.get_args_parser().parse_args(argv)
    assert (ns.tee, ns.redirects, ns.local_ranks_filter, ns.start_method, ns.no_python) == ("3", "1", "0", "fork", True)
    assert ns.rdzv_conf == "store_type=file,join_timeout=60"
    assert "--no-python" not in {a.option_strings[-1] for a in _parser_actions("train")}  # run's flag only


def _parser_actions(command: str) -> list:
    from paratrain.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and command in a.choices)
    return sub.choices[command]._actions


@pytest.mark.parametrize("value, message", [("gpu", "--nproc-per-node gpu: "), ("seven", "not a number of workers"),
                                            ("0", "must be at least 1")])
def test_nproc_per_node_words_and_errors(value: str, message: str) -> None:
    from paratrain.launch.torchrun import nproc_per_node

    assert nproc_per_node("3") == 3 and nproc_per_node("cpu") >= 1 and nproc_per_node("auto") >= 1
    with pytest.raises(ValueError, match=message) as e:
        if value == "gpu":
            import torch

            if torch.cuda.is_available():
                pytest.skip("a GPU is here: gpu resolves")
        nproc_per_node(value)
    assert "\n" not in str(e.value)


def test_standalone_with_an_address_is_refused() -> None:
    with pytest.raises(ValueError, match="--standalone is one node"):
        LaunchConfig(standalone=True, nnodes="2", master_addr="10.0.0.1")


def test_c10d_with_a_master_address_says_where_c10d_meets() -> None:
    with pytest.raises(ValueError, match="rdzv_backend='c10d' meets at --rdzv-endpoint HOST:PORT, not at --master-addr: "
                                         "give --rdzv-endpoint 10.0.0.1:29400"):
        LaunchConfig(nnodes="2", rdzv_backend="c10d", master_addr="10.0.0.1")


def test_no_python_tee_and_rank_filter_run_a_program(tmp_path: Path) -> None:
    """``--no-python`` runs a program that is not Python; ``--tee 3 --local-ranks-filter 1`` shows
    only local rank 1's output, prefixed as torchrun prefixes it."""
    r = run_cli(["--standalone", "--nproc-per-node", "2", "--no-python", "--tee", "3", "--local-ranks-filter", "1",
                 "--log-dir", str(tmp_path), "sh", "-c", "echo hello from rank $RANK"])
    assert r.returncode == 0, r.stderr[-4000:]
    assert "hello from rank 1" in r.stdout and "hello from rank 0" not in r.stdout, r.stdout


HANGING_LOOP = '''
import time
import torch
import paratrain

pt = paratrain.Parallel(strategy="ddp", global_batch=2, timeout_s=3)
if pt.rank == 1:
    time.sleep(60)  # never arrives at the all-reduce
pt.reduce(torch.tensor(1.0), "sum")
'''


@pytest.mark.waits
def test_own_script_collective_timeout_ends_with_its_cause(tmp_path):
    """A script's own loop under `paratrain run`: nothing of paratrain is on the stack when its
    all-reduce times out, yet the worker ends with one line naming the rank that did not arrive
    and the collective (Parallel installs it as the script's excepthook)."""
    script = tmp_path / "hang.py"
    script.write_text(HANGING_LOOP)
    res = run_cli(["--nproc-per-node", "2", str(script)], timeout=75)
    assert res.returncode != 0
    assert ("paratrain: CollectiveTimeoutError: rank 1 did not arrive at a collective (all_reduce in Parallel.reduce) for 3 s "
            "(timeout_s)") in res.stderr, res.stderr[-3000:]


RAISES_ON_RANK_1 = """
import torch
import paratrain

pt = paratrain.Parallel(strategy="ddp", global_batch=2, timeout_s=20)
if pt.rank == 1:
    raise KeyError("input_ids")  # a script's own error, no @record
pt.reduce(torch.tensor(1.0), "sum")
"""


def test_own_script_error_is_named_in_the_launchers_last_line(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(RAISES_ON_RANK_1)
    res = run_cli(["--nproc-per-node", "2", str(script)], timeout=75)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and last.startswith("paratrain run: error: worker "), res.stderr[-3000:]
    assert "rank 1" in last and last.endswith("failed (exit code 1): KeyError: 'input_ids'"), last


NO_CLOSE = """
import atexit
import os

import torch
import torch.distributed as dist

import paratrain

# registered before Parallel's, so it runs after it (atexit is last in, first out)
atexit.register(lambda: os.write(1, f"rank {rank}: in a group at exit: {dist.is_initialized()}\\n".encode()))
pt = paratrain.Parallel(strategy="ddp", global_batch=2)
rank = pt.rank
pt.reduce(torch.tensor(1.0), "sum")  # and no pt.close()
"""


def test_a_script_that_does_not_close_leaves_the_group_at_exit(tmp_path):
    # Without it a gloo rank can die at exit with SIGABRT while its peer still uses their connection
    # (2 runs in 5 of a plain torchrun script): paratrain meets its peers in a barrier, then leaves.
    script = tmp_path / "no_close.py"
    script.write_text(NO_CLOSE)
    res = run_cli(["--nproc-per-node", "2", str(script)], timeout=75)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(line for line in res.stdout.splitlines() if "at exit" in line) == [
        "rank 0: in a group at exit: False", "rank 1: in a group at exit: False"]


def test_pet_variables_are_the_launch_flags_defaults(monkeypatch):
    """torchrun reads every flag from PET_<FLAG> (how the Kubeflow PyTorchJob operator launches);
    so do paratrain run/train, and a flag on the command line still wins. torchrun's other flags
    (--role...) pass through."""
    import argparse

    from paratrain.cli.run import add_launch_arguments, launch_config, torchrun_flags

    for k, v in dict(PET_NPROC_PER_NODE="4", PET_NNODES="2", PET_NODE_RANK="1", PET_MASTER_ADDR="10.0.0.1",
                     PET_MASTER_PORT="23456", PET_MAX_RESTARTS="3").items():
        monkeypatch.setenv(k, v)
    p = argparse.ArgumentParser()
    add_launch_arguments(p)
    cfg = launch_config(p.parse_args([]))
    assert (cfg.nproc_per_node, cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port, cfg.max_restarts) == (
        4, "2", 1, "10.0.0.1", 23456, 3)
    args = p.parse_args(["--nproc-per-node", "2", "--role", "trainer"])
    assert launch_config(args).nproc_per_node == 2 and torchrun_flags(args) == ["--role=trainer"]
