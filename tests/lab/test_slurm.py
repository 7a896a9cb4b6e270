"""Real Slurm (the lab's slurmctld + slurmd on this machine): ``srun -n 2 paratrain train`` reads its
place from Slurm's variables and equals ``paratrain train --nproc-per-node 2``; ``sbatch
examples/slurm.sbatch`` (``srun paratrain run``) trains like one plain-PyTorch process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch

from clitools import ROOT, cli_env, finish, killpg, start_cli
from labrun import TRAIN_ARGS, assert_same_run, paratrain_on_path
from parity import assert_same_state


def slurm_cmd(lab_slurm, argv, timeout, **extra):
    """Run a Slurm client command in its own process group; past ``timeout`` kill it and fail."""
    env = paratrain_on_path({**cli_env(), "SLURM_CONF": str(lab_slurm.conf_path()), **extra})  # `paratrain` for sbatch
    p = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--full", "--partition=lab"], env=env)
        pytest.fail(f"{argv} ran past {timeout}s")
    finally:
        killpg(p)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


@pytest.mark.timeout(240)
def test_srun_two_tasks_read_slurm_and_train_like_nproc_per_node_2(lab_slurm, nproc2_run, tmp_path):
    where = slurm_cmd(lab_slurm, ["srun", "-n", "2", sys.executable, "-c",
                                  "import json, os, paratrain.env as e; os.write(1, (json.dumps(e.detect_process().__dict__) + chr(10)).encode())"], 60)
    assert where.returncode == 0, where.stderr
    infos = sorted((json.loads(line) for line in where.stdout.splitlines()), key=lambda i: i["rank"])
    assert [(i["rank"], i["world_size"], i["local_rank"], i["source"]) for i in infos] == [
        (0, 2, 0, "slurm"), (1, 2, 1, "slurm")]
    assert infos[0]["master_addr"] == infos[1]["master_addr"] == socket.gethostname()  # SLURM_NODELIST's first
    r = slurm_cmd(lab_slurm, ["srun", "-n", "2", "paratrain", "train", *TRAIN_ARGS,
                              "--log-dir", str(tmp_path)], 150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ddp on 2 process(es)" in r.stdout + r.stderr
    assert_same_run(tmp_path, nproc2_run)


@pytest.mark.timeout(240)
def test_sbatch_example_srun_paratrain_run_trains_like_one_process(lab_slurm, tmp_path):
    import importlib.util

    script = ROOT / "tests" / "scripts" / "lab_train.py"
    r = slurm_cmd(lab_slurm, ["sbatch", "--wait", f"--output={tmp_path}/job.out", str(ROOT / "examples" / "slurm.sbatch"),
                              str(script), str(tmp_path / "out.pt")], 180, NPROC_PER_NODE="2")
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert r.returncode == 0, r.stderr + log[-3000:]
    spec = importlib.util.spec_from_file_location("lab_train", script)
    lab_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab_train)
    got = torch.load(tmp_path / "out.pt")
    assert got["world_size"] == 2
    assert_same_state(got["state"], lab_train.PROBLEM.reference().state, lab_train.PROBLEM.rtol)


@pytest.mark.timeout(180)
def test_sbatch_script_calling_paratrain_train_is_not_rank_0_of_its_tasks(lab_slurm, tmp_path):
    """`sbatch --ntasks 2` whose script runs `paratrain train` itself (no srun): the script's
    process has SLURM_PROCID=0 and SLURM_NTASKS=2 but is no task of a step, so it trains as one
    process instead of waiting for a rank 1 that never starts."""
    r = slurm_cmd(lab_slurm, ["sbatch", "--wait", "--ntasks", "2", f"--output={tmp_path}/job.out", "--wrap",
                              f"paratrain train --max-steps 2 --no-progress --log-dir {tmp_path}/run"],
                  150)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert r.returncode == 0, r.stderr + log[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["world_size"] == 1, result


_PREEMPT_JOB = """#!/bin/bash
#SBATCH --time=3
#SBATCH --signal=USR1@100
#SBATCH --requeue
set -uo pipefail
echo "attempt ${SLURM_RESTART_COUNT:-0}"
srun PYTHON -m paratrain ARGS
echo "srun exit $?"
"""


@pytest.mark.timeout(600)
def test_sbatch_signal_usr1_saves_requeues_and_the_requeued_job_resumes_bit_exact(lab_slurm, tmp_path):
    """Issue 26: ``sbatch --signal=USR1@100 --requeue``. Slurm sends SIGUSR1 100 s before the job's
    limit (steps slowed by tests/faults while the first attempt trains); paratrain saves at one step,
    requeues the job itself (``scontrol requeue``) and the requeued job resumes from that checkpoint to
    the uninterrupted run's weights (its steps are not slowed: it ends before a signal). Once the first
    attempt trains, the test cuts its limit from 3 minutes to 2 (``scontrol update TimeLimit=2``), so
    the signal comes 20-50 s after the start (Slurm checks limits every 30 s), not 80-110 s; and it lets
    the requeued job start at once, with its 3 minutes back (Slurm holds a requeued job for 2 minutes,
    then waits for its next scheduling pass)."""
    import time

    from paratrain.checkpoint import list_checkpoints

    args = ["train", "--strategy", "ddp", "--nproc-per-node", "2", "--max-steps", "400", "--global-batch", "32",
            "--no-progress", "--checkpoint-every", "100"]
    ref_run = start_cli([*args, "--log-dir", str(tmp_path / "ref")])  # while the job's slowed first attempt runs
    job = tmp_path / "preempt.sbatch"
    job.write_text(_PREEMPT_JOB.replace("PYTHON", sys.executable).replace("ARGS", " ".join([*args, "--name", "preempted"])))
    env = {**cli_env(PARATRAIN_TEST_SLOW_STEPS="0.4"), "SLURM_CONF": str(lab_slurm.conf_path())}
    out = tmp_path / "job.out"
    r = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={out}", "--open-mode=append",
                        str(job)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]

    def show() -> str:
        return subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout

    def update(*fields: str) -> None:
        subprocess.run(["scontrol", "update", f"JobId={job_id}", *fields], env=env, capture_output=True, timeout=30)

    try:
        deadline = time.monotonic() + 480
        cut = False
        while time.monotonic() < deadline:
            state = show()
            if "JobState=COMPLETED" in state or "JobState=FAILED" in state or "JobState=CANCELLED" in state:
                break
            if not cut and "Restarts=0" in state and (tmp_path / "runs" / "preempted" / "config.toml").exists():
                update("TimeLimit=2")  # it trains (rank 0 wrote its config: stop signals are handled)
                cut = True
            if "Restarts=1" in state and "JobState=PENDING" in state and "Reason=BeginTime" in state:
                # StartTime=now (not BeginTime=now, which Slurm 22.05 takes without effect) also runs the scheduler
                update("TimeLimit=3", "StartTime=now")
            time.sleep(1)
        log = out.read_text() if out.exists() else ""
        assert "JobState=COMPLETED" in show(), show() + log[-4000:]
    finally:
        subprocess.run(["scancel", job_id], env=env, timeout=30)
        ref = finish(ref_run, 240)
    assert ref.returncode == 0, ref.stderr[-3000:]
    line = next((ln for ln in log.splitlines() if ln.startswith("preempted at step")), "")
    assert line.endswith(f"checkpoint saved; continue with --resume; Slurm job {job_id} requeued: it resumes by "
                         "itself"), log[-4000:]
    step = int(line.split()[3].rstrip(":"))
    assert cut and 0 < step < 400 and "attempt 1" in log and f"resumed from step {step}" in log, log[-4000:]
    run = tmp_path / "runs" / "preempted"
    assert json.loads((run / "result.json").read_text())["steps"] == 400
    got, want = (torch.load(list_checkpoints(d)[-1], weights_only=True)["model"]
                 for d in (run / "checkpoints", tmp_path / "ref" / "checkpoints"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
