"""Telling a scale-up restart from a new job: torchrun's agent restarts its workers when a node
joins an elastic job without counting a restart (TORCHELASTIC_RESTART_COUNT stays 0), so
``paratrain train`` keeps the job's rendezvous id in the checkpoint folder and resumes when it finds
its own. The real scale-up, across two lab hosts, is ``tests/lab/test_elastic.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import paratrain.loop.train as train
from paratrain.launch.torchrun import PRIVATE_RDZV_ID


@pytest.fixture
def rank0(monkeypatch):
    monkeypatch.setattr(train, "_rank0_says", lambda pt, flag: flag)  # one process: rank 0's word is its own
    return SimpleNamespace(is_main_process=True)


def test_same_rendezvous_id_is_the_same_job_and_another_is_a_new_one(rank0, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert not train._same_elastic_job(rank0, str(tmp_path / "ckpt"))  # first start: a new job, marked
    assert (tmp_path / "ckpt" / train.JOB_MARKER).read_text() == "job-7\n"
    assert train._same_elastic_job(rank0, str(tmp_path / "ckpt"))  # restarted on a new membership
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    assert not train._same_elastic_job(rank0, str(tmp_path / "ckpt"))  # another job into the same folder
    assert (tmp_path / "ckpt" / train.JOB_MARKER).read_text() == "job-8\n"


@pytest.mark.parametrize("job", [None, "none", f"{PRIVATE_RDZV_ID}0123abcd"])
def test_no_job_identity_never_resumes_and_writes_nothing(rank0, tmp_path, monkeypatch, job):
    if job is None:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
    for _ in range(2):
        assert not train._same_elastic_job(rank0, str(tmp_path))
    assert list(tmp_path.iterdir()) == []
