"""Ranks that fall out of step end in one line (issue 36): a skipped collective, other sizes, another
op, and an error inside an fsdp step, under ``paratrain.launch`` and ``paratrain run``, each with 2
real processes over gloo. gloo aborts a rank (SIGABRT) on a size mismatch, as NCCL's watchdog aborts a
rank whose collective timed out (simulated: a timer aborts the waiting rank); the launcher reads every
rank's record of its collectives (``paratrain.trace``) and names the rank, the collective and the step.
On a machine with 2 GPUs the same file runs under nccl (the job's tensors are on ``pt.device``):
``scripts/device_check.sh``'s ``hangs`` step."""

from __future__ import annotations

import time

import pytest
from clitools import run_cli
from fastlaunch import launch
from pace import scaled

from paratrain.launch.spawn import LaunchError

pytestmark = pytest.mark.timeout(240)
TIMEOUT_S = 5  # Parallel(timeout_s): the "other op" case waits it out

JOB = """
import sys, time, torch, torch.distributed as dist
import paratrain

def job(rank, case, strategy="ddp", check=False):
    pt = paratrain.Parallel(strategy=strategy, timeout_s=TIMEOUT_S, global_batch=8, check_collectives=check)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = pt.setup(model, opt)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    for x, y in pt.train_loader(data):
        opt.zero_grad()
        if case == "raise" and pt.global_step == 3 and rank == 1:
            raise RuntimeError("boom in rank 1's step")
        loss = pt.training_step(model, (x, y), torch.nn.functional.cross_entropy)
        metric = loss.detach().clone()
        if pt.global_step == 3 and case == "skip" and rank == 1:
            pass  # rank 1 skips the metric's all_reduce
        elif pt.global_step == 3 and case == "mismatch":
            dist.all_reduce(torch.ones(10 if rank == 0 else 20, device=pt.device))  # MISMATCH_LINE
        elif pt.global_step == 3 and case == "other" and rank == 1:
            dist.broadcast(torch.ones(1, device=pt.device), src=0)  # OTHER_LINE
        elif pt.global_step == 3 and case == "watchdog" and rank == 1:
            time.sleep(120)  # frozen
        elif pt.global_step == 3 and case == "watchdog":
            import os, threading  # NCCL's watchdog, simulated: it aborts a rank whose collective timed out
            threading.Timer(2.0, os.abort).start()
            dist.all_reduce(metric)  # WATCHDOG_LINE
        else:
            dist.all_reduce(metric)  # METRIC_LINE
        opt.step()
    pt.close()
    return 0

if __name__ == "__main__":
    import os
    job(int(os.environ["RANK"]), sys.argv[1], sys.argv[2])
""".replace("TIMEOUT_S", str(TIMEOUT_S))


def _line_of(tag: str) -> int:
    return next(i for i, line in enumerate(JOB.splitlines(), 1) if line.rstrip().endswith(tag))


def _job_here():
    """JOB's ``job``, defined in this module (so the workers unpickle it) at JOB's own lines of ``hangjob.py``."""
    exec(compile(JOB, "hangjob.py", "exec"), globals())  # noqa: S102
    return globals()["job"]


job = _job_here()

METRIC, MISMATCH, OTHER = _line_of("METRIC_LINE"), _line_of("MISMATCH_LINE"), _line_of("OTHER_LINE")
EXPECTED = {
    "skip": (f"rank 1 skipped all_reduce #8 (hangjob.py:{METRIC}, step 3): rank 0 waits in it, rank 1 is already in "
             "DDP's all_reduce #8 (hangjob.py:"),
    "mismatch": (f"all_reduce #8 at step 3 got 10 float32 on rank 0 (hangjob.py:{MISMATCH}) and 20 float32 on rank 1 "
                 f"(hangjob.py:{MISMATCH}): every rank must pass the same size"),
    "watchdog": (f"rank 1 did not reach all_reduce #8 (hangjob.py:{_line_of('WATCHDOG_LINE')}, step 3), where rank 0 waits: rank 1's "
                 "last was DDP's all_reduce #7 (hangjob.py:"),
    "other": (f"the ranks called different collectives as #8: rank 0 in all_reduce #8 (hangjob.py:{METRIC}, step 3), "
              f"rank 1 in broadcast #8 (hangjob.py:{OTHER}, step 3)"),
}


def _ends_in_time(t0: float) -> None:
    # the promise: within timeout_s + 15 s of going wrong; the start-up of 2 workers is the machine's allowance
    assert time.monotonic() - t0 < TIMEOUT_S + 15 + scaled(15)


@pytest.mark.waits
@pytest.mark.parametrize("case", ["skip", "mismatch", "other", "watchdog"])
def test_launch_names_the_rank_the_collective_and_the_step(case):
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        launch(job, 2, args=(case,), timeout=120)
    line = str(e.value)
    _ends_in_time(t0)
    assert "\n" not in line and EXPECTED[case] in line, line


def test_an_error_in_an_fsdp_step_names_the_rank_and_what_the_other_waits_in():
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        launch(job, 2, args=("raise", "fsdp"), timeout=120)
    line = str(e.value)
    _ends_in_time(t0)
    assert line.startswith("rank 1 failed: RuntimeError: boom in rank 1's step; ") and "\n" not in line, line
    # rank 0 went on into step 3's forward: it waits in a collective rank 1 never reached
    assert "which rank 1 did not reach" in line and "step 3" in line, line


@pytest.mark.parametrize("case", ["skip", "mismatch"])
def test_checked_mode_stops_before_the_collective_on_every_rank(case):
    """Parallel(check_collectives=True): the ranks compare each collective before it runs; the first
    difference raises the same line on every rank (no abort, no timeout)."""
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        launch(job, 2, args=(case, "ddp", True), timeout=120)
    line = str(e.value)
    assert time.monotonic() - t0 < scaled(30)  # no timeout waited out
    assert "CollectiveMismatchError: " in line and EXPECTED[case] in line and "\n" not in line, line
    assert "SIGABRT" not in line


@pytest.mark.parametrize("case", ["skip", "mismatch"])
def test_paratrain_run_says_it_in_its_last_line(tmp_path, case):
    script = tmp_path / "hangjob.py"
    script.write_text(JOB)
    t0 = time.monotonic()
    res = run_cli(["run", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(script), case, "ddp"],
                  timeout=150)
    _ends_in_time(t0)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("paratrain run: error: ") and EXPECTED[case] in last, res.stderr[-3000:]
    assert "killed by SIGABRT)" in last
    # the post-mortem reads the same records from the run's folder
    doctor = run_cli(["doctor", str(tmp_path / "logs")], timeout=60)
    assert doctor.returncode == 1, doctor.stderr
    lines = doctor.stdout.splitlines()
    assert lines[0].startswith("records of 2 rank(s) (0, 1) in ") and lines[1] == f"doctor: {EXPECTED[case]}" or \
        lines[1].startswith(f"doctor: {EXPECTED[case]}"), doctor.stdout
    assert lines[3].split()[:3] == ["rank", "seq", "op"] and any(" all_reduce " in ln for ln in lines[4:])


def test_doctor_on_a_folder_without_records_is_one_line(tmp_path):
    res = run_cli(["doctor", str(tmp_path)], timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "holds no records of collectives" in res.stderr
