"""Elastic shrink with the same numerics: a 2-host job (``--nnodes 1:2 --max-restarts 1``, c10d
rendezvous) loses a host mid-run; the survivor's rendezvous re-forms alone, resumes from the last
checkpoint at world size 1 with the same global batch, and ends on the weights of an uninterrupted
2-process run. And the reverse: a job that started on one host grows to two when a second host
joins (torchrun's agent restarts its workers on the new membership), resumes from the last
checkpoint at world size 2, and ends on the same weights."""

from __future__ import annotations

import os
import time

import pytest


from labrun import TRAIN_ARGS, assert_same_run, finish_all, start
from pace import scaled


def wait_for_checkpoint(ckpt, step, procs, timeout=120):
    """Until ``latest`` names step ``step``'s checkpoint: it is replaced after the checkpoint's files and
    digests, and it is what a resume takes (its ``.sha256`` appears earlier, and a busy machine can
    stretch the gap)."""
    latest, want = ckpt / "latest", f"step-{step:08d}"
    deadline = time.monotonic() + timeout
    while not (latest.exists() and want in latest.read_text()):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            ended = [f"host {k} exited {p.returncode}:\n{p.communicate()[1][-2000:]}" for k, p in enumerate(procs)
                     if p.poll() is not None]  # what the ones that ended said
            raise AssertionError(f"latest never named {want}: exit codes {[p.poll() for p in procs]}\n" + "\n".join(ended))
        time.sleep(0.2)


def elastic_args(lab, ckpt, rdzv_id: str) -> list[str]:
    return ["train", *TRAIN_ARGS, "--checkpoint-dir", str(ckpt), "--backend", "gloo", "--set", "parallel.timeout_s=10",
            "--nproc-per-node", "1", "--nnodes", "1:2", "--max-restarts", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{lab.name(0)}:29515", "--rdzv-id", rdzv_id]


@pytest.mark.timeout(300)
def test_lost_host_shrinks_to_one_and_ends_on_the_uninterrupted_weights(fresh_lab, nproc2_run, tmp_path):
    lab = fresh_lab
    ckpt = tmp_path / "ckpt"  # one folder both hosts see (a cluster's shared file system)
    # last_call_timeout: the first round waits that long for host 1 after host 0 arrived, and the survivor's
    # new round closes that long after it has its one node (torch's default waits 30 s). 2 s was too short
    # on a busy machine: host 1's agent came later, host 0 trained the whole run alone and nothing was cut.
    args = [*elastic_args(lab, ckpt, "lab-elastic"), "--rdzv-conf", f"last_call_timeout={round(scaled(8))}"]
    # host 1's rank stops at step 25 (first attempt), so the job is mid-run, past the step-20 checkpoint,
    # whenever the cut comes; c10d numbers the ranks on arrival, so `*`: whichever rank host 1 has
    procs = [start(lab, k, [*args, "--log-dir", str(tmp_path / f"h{k}")], **({"PARATRAIN_TEST_HANG_AT": "*:25"} if k else {}))
             for k in range(2)]
    wait_for_checkpoint(ckpt, 20, procs)
    lab.cut(1)
    for pid in lab.pids(lab.name(1)):  # the host is lost, not just silent: its processes go too
        os.kill(pid, 9)
    survivor, _ = finish_all(procs, 200)
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    said = survivor.stdout + survivor.stderr
    assert "resumed from step 20" in said, said[-3000:]
    assert "ddp on 1 process(es)" in said
    err = assert_same_run(tmp_path / "h0", nproc2_run, world_size=1, checkpoints=ckpt)
    print(f"after the shrink: relative error {err:.1e} against the uninterrupted 2-process run")


@pytest.mark.timeout(300)
def test_joining_host_grows_one_to_two_and_ends_on_the_uninterrupted_weights(fresh_lab, nproc2_run, tmp_path):
    lab = fresh_lab
    ckpt = tmp_path / "ckpt"
    # host 0 starts alone (the rendezvous closes 2 s after its one node arrived), trains at world 1
    # past the step-20 checkpoint and waits at step 25 for company: host 1's arrival makes host 0's
    # agent restart its worker (a membership change, not a failure: no restart is spent)
    args = [*elastic_args(lab, ckpt, "lab-grow"), "--rdzv-conf", "last_call_timeout=2"]
    first = start(lab, 0, [*args, "--log-dir", str(tmp_path / "h0")], PARATRAIN_TEST_WAIT_ALONE_AT="25")
    wait_for_checkpoint(ckpt, 20, [first])
    second = start(lab, 1, [*args, "--log-dir", str(tmp_path / "h1")])
    grown, joined = finish_all([first, second], 200)
    for p in (grown, joined):
        assert p.returncode == 0, p.stderr[-3000:]
    said = "".join(p.stdout + p.stderr for p in (grown, joined))  # rank 0 of the grown group is either host
    assert "ddp on 1 process(es)" in said and "ddp on 2 process(es)" in said, said[-3000:]
    assert "resumed from step 20" in said, said[-3000:]
    rank0 = next(tmp_path / h for h in ("h1", "h0") if (tmp_path / h / "result.json").exists())
    err = assert_same_run(rank0, nproc2_run, world_size=2, checkpoints=ckpt)
    print(f"after growing from 1 to 2 hosts: relative error {err:.1e} against the uninterrupted 2-process run")
