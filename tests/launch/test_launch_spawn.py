import pytest
import torch
import torch.distributed as dist

import paratrain
from paratrain.launch.spawn import LaunchError


def _sum_ranks(local_rank, scale):
    d = paratrain.init()
    t = torch.tensor([float(d.rank)])
    dist.all_reduce(t)
    paratrain.destroy()
    return (d.rank, d.world_size, d.backend, t.item() * scale)


def test_launch_returns_results_in_rank_order():
    out = paratrain.launch(_sum_ranks, nprocs=2, args=(10,), timeout=60)
    assert out == [(0, 2, "gloo", 10.0), (1, 2, "gloo", 10.0)]


def _fail_on_rank_1(local_rank):
    d = paratrain.init(timeout_s=20)
    if d.rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever without the launcher's cleanup


def test_failure_names_rank_and_does_not_hang():
    with pytest.raises(LaunchError, match=r"rank 1 failed: ValueError: boom on purpose"):
        paratrain.launch(_fail_on_rank_1, nprocs=2, timeout=60)


def _aborts_at_exit(local_rank, before_returning):
    import multiprocessing.util
    import os

    if before_returning and local_rank == 1:
        os.abort()
    if local_rank == 1:  # as gloo's threads do on torch 2.13 now and then: the work is done, teardown dies
        multiprocessing.util.Finalize(None, os.abort, exitpriority=0)
    return local_rank * 10


def test_a_rank_that_dies_in_teardown_after_returning_keeps_every_result():
    with pytest.warns(RuntimeWarning, match="rank 1 was ended by SIGABRT after it returned its result"):
        assert paratrain.launch(_aborts_at_exit, nprocs=2, args=(False,), timeout=60) == [0, 10]
    with pytest.raises(LaunchError, match="rank 1 exited with code -6"):  # before returning: a failure
        paratrain.launch(_aborts_at_exit, nprocs=2, args=(True,), timeout=60)


def _hang(local_rank):
    import time
    time.sleep(600)


@pytest.mark.waits
def test_timeout_kills_workers():
    with pytest.raises(LaunchError, match="timed out"):
        paratrain.launch(_hang, nprocs=2, timeout=3)


def _where(local_rank):
    import multiprocessing
    import os
    import sys

    # a DataLoader's workers fork, as in a new interpreter, not through a forkserver of this rank's own
    assert multiprocessing.get_start_method(allow_none=True) is None, multiprocessing.get_start_method()
    return os.getpid(), os.environ["PARATRAIN_TEST_VALUE"], os.environ["RANK"], "paratrain.bench.worker" in sys.modules


def test_forkserver_launch_gives_fresh_processes_with_preloaded_modules_and_env():
    """bench's launches: new processes each time, forked from a server that imported the worker once."""
    runs = [paratrain.launch(_where, nprocs=2, timeout=90, env={"PARATRAIN_TEST_VALUE": str(i)},
                             start_method="forkserver", preload=["paratrain.bench.worker"]) for i in range(2)]
    pids = {pid for run in runs for pid, *_ in run}
    assert len(pids) == 4
    assert [(value, rank) for run in runs for _, value, rank, _ in run] == [("0", "0"), ("0", "1"), ("1", "0"),
                                                                            ("1", "1")]
    assert all(preloaded for run in runs for *_, preloaded in run)
    with pytest.raises(ValueError, match="start_method 'fork' is unknown"):
        paratrain.launch(_where, nprocs=1, start_method="fork")


def test_a_forkserver_that_preloads_anything_imports_what_a_training_worker_imports(monkeypatch):
    """The first optimizer imports torch._dynamo (2-3 s of CPU): paratrain.launch's server imports it once, not
    each worker (the suite's own launches, tests/fastlaunch.py, preload it through pipelining anyway)."""
    from paratrain.launch import spawn
    from paratrain.launch.forkserver import TRAINING_IMPORTS

    asked = []
    monkeypatch.setattr(spawn.mp.get_context("forkserver"), "set_forkserver_preload", asked.append)

    def started(*args, **kwargs):
        raise RuntimeError("no workers in this test")

    monkeypatch.setattr(spawn.mp, "start_processes", started)
    with pytest.raises(RuntimeError, match="no workers"):
        spawn.launch(_where, nprocs=1, start_method="forkserver", preload=["paratrain.bench.worker"])
    assert asked == [["paratrain.bench.worker", *TRAINING_IMPORTS]] and "torch._dynamo" in TRAINING_IMPORTS


def _own_loop_hangs_on_rank_1(local_rank):
    import time

    pt = paratrain.Parallel(strategy="ddp", global_batch=2, timeout_s=3)
    if pt.rank == 1:
        time.sleep(30)  # never arrives; the launch ends it once rank 0 failed
        return None
    return pt.reduce(torch.tensor(1.0), "sum")


@pytest.mark.waits
def test_own_loop_collective_timeout_names_the_rank_and_the_collective():
    """Your own loop, not paratrain train: a rank that never arrives is named, with the collective
    the others waited in, in the one line the launch raises (rank 0's error)."""
    with pytest.raises(LaunchError, match=r"rank 0 failed: .*CollectiveTimeoutError: rank 1 did not arrive at a "
                                          r"collective \(all_reduce in Parallel\.reduce\) for 3 s \(timeout_s\).*rank 0 waited for it"):
        paratrain.launch(_own_loop_hangs_on_rank_1, nprocs=2, timeout=90)


def _saves_on_the_main_process_only(local_rank, directory):
    import time

    pt = paratrain.Parallel(strategy="ddp", global_batch=2, timeout_s=3)
    net = torch.nn.Linear(2, 2)
    model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    if pt.rank == 1:
        time.sleep(30)  # the habit of a hand-written DDP script: only rank 0 saves
        return None
    pt.save_checkpoint(directory, model, opt)


@pytest.mark.waits
def test_a_collective_method_called_on_one_rank_is_named(tmp_path):
    with pytest.raises(LaunchError, match=r"rank 1 did not arrive at a collective \(\w+ in Parallel\.save_checkpoint\).*"
                                          r"Parallel\.save_checkpoint is a collective: does every rank call it"):
        paratrain.launch(_saves_on_the_main_process_only, nprocs=2, args=(str(tmp_path / "ckpt"),), timeout=90)


def test_collective_of_reads_the_traceback():
    from paratrain.env.process import collective_of

    def barrier():
        raise RuntimeError("Timed out")

    def backward():
        raise RuntimeError("Timed out")

    for fn, op in ((barrier, "barrier"), (backward, "the gradient reduction in backward"), (lambda: 1 / 0, "a collective")):
        try:
            fn()
        except (RuntimeError, ZeroDivisionError) as e:
            assert collective_of(e) == op


_AS_PID_1 = r"""
import os, subprocess, sys
import paratrain

def parent(local_rank):
    paratrain.init()  # arms the end-with-the-launcher signal
    return os.getppid()

if __name__ == "__main__":
    assert os.getpid() == 1
    # paratrain.launch from PID 1 (a container's command): its worker's parent is PID 1, alive
    print("launch", paratrain.launch(parent, 1, timeout=120), flush=True)
    code = "from paratrain.env.process import die_with_launcher; die_with_launcher(); print('alive', flush=True)"
    # a plain torchrun worker whose agent is PID 1: nothing tells a dead launcher from this one
    plain = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TORCHELASTIC_RUN_ID": "x"})
    print("plain", plain.returncode, flush=True)
    # paratrain's launcher (pid 99999) is gone and the worker was handed to PID 1: it ends
    gone = subprocess.run([sys.executable, "-c", code],
                          env={**os.environ, "TORCHELASTIC_RUN_ID": "x", "PARATRAIN_AGENT_PID": "99999"})
    print("gone", gone.returncode, flush=True)
"""


def test_workers_run_when_the_launcher_is_pid_1(tmp_path):
    """In a container the launcher is often PID 1: its workers' parent is PID 1 while it lives, so
    a parent of 1 alone does not mean that the launcher died (every worker once killed itself)."""
    import os
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (a PID namespace)")
    script = tmp_path / "as_pid_1.py"
    script.write_text(_AS_PID_1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(["timeout", "-k", "10", "150", "unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                          str(script)], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "launch [1]" in out.stdout and "plain 0" in out.stdout and "gone -15" in out.stdout, out.stdout


def test_launch_from_inside_a_torchrun_worker_forms_its_own_group(monkeypatch):
    """A torchrun worker's variables (its agent's store) are not the launched workers': they once
    all waited as clients of a store nobody served."""
    for k, v in dict(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="outer", TORCHELASTIC_RESTART_COUNT="0",
                     ROLE_RANK="3", ROLE_NAME="default", GROUP_WORLD_SIZE="4").items():
        monkeypatch.setenv(k, v)
    out = paratrain.launch(_sum_ranks, nprocs=2, args=(1,), timeout=60, start_method="spawn")  # not the suite's own
    assert out == [(0, 2, "gloo", 1.0), (1, 2, "gloo", 1.0)]
