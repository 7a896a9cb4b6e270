"""The record of every collective (``paratrain.trace``): the ring, what a call records, and the one
line the ranks' records give for each way they go apart. Real processes: ``test_hangs.py``."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from paratrain.trace import analyze, recorder
from paratrain.trace.recorder import Record, Recorder, read_dir, read_file


def rec(rank, seq, op="all_reduce", numel=10, step=3, where="train.py:30", by="", state="started", dtype="float32",
        micro=0, group="0", t=None):
    return Record(rank, seq, op, group, numel, dtype, step, micro, state, by, where, t if t is not None else seq)


def test_the_ring_keeps_the_last_records_in_a_file_the_process_leaves_behind(tmp_path):
    path = str(tmp_path / "rank-1.trace")
    r = Recorder(1, 2, path, slots=4)
    t = torch.ones(3, dtype=torch.float64)
    for k in range(6):
        index = r.enter("all_reduce" if k % 2 else "broadcast", None if k < 5 else _Group("7"), t, depth=1)
        if k < 5:
            r.leave(index)
    got = read_file(path)  # read as a launcher would, while (or after) the process runs
    assert [(x.seq, x.op, x.group, x.state) for x in got] == [
        (3, "broadcast", "", "done"), (4, "all_reduce", "", "done"), (5, "broadcast", "", "done"),
        (1, "all_reduce", "7", "started")]
    assert got[0].numel == 3 and got[0].dtype == "float64" and got[0].rank == 1
    assert got[0].where == f"{os.path.basename(__file__)}:{test_the_ring_keeps_the_last_records_in_a_file_the_process_leaves_behind.__code__.co_firstlineno + 5}"
    r.leave(0)  # written over since: left alone
    assert [x.state for x in read_file(path)] == ["done", "done", "done", "started"]
    assert read_dir(str(tmp_path)) == {1: got}
    assert read_file(str(tmp_path / "nothing")) == [] and read_dir(str(tmp_path / "no")) == {}


def test_a_hook_with_no_python_caller_is_recorded(tmp_path):
    """On CUDA the autograd engine runs DDP's comm hook on its own device thread, with no Python frame
    above the hook: the record takes the outermost frame there is (the device check's syncbn, ddp x2 on
    an H200, failed with "call stack is not deep enough" before)."""
    import threading

    r = Recorder(0, 2, str(tmp_path / "rank-0.trace"), slots=4)
    got = []
    thread = threading.Thread(target=lambda: got.append(r.enter("all_reduce", None, torch.ones(2), by="DDP",
                                                                  depth=1000)))
    thread.start()
    thread.join(10)
    assert got == [0]
    (rec,) = read_file(str(tmp_path / "rank-0.trace"))
    assert (rec.op, rec.by, rec.numel, rec.state) == ("all_reduce", "DDP", 2, "started")


class _Group:
    def __init__(self, name):
        self.group_name = name


def test_each_wrapped_call_is_recorded_with_its_caller_and_step(tmp_path, monkeypatch):
    monkeypatch.setenv(recorder.TRACE_DIR, str(tmp_path))
    before = dist.all_reduce
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        r = recorder.start(0, 1)
        assert recorder.start(0, 1) is r  # a second Parallel keeps the ring
        recorder.set_position(lambda: (7, 1))
        x = torch.ones(5)
        dist.all_reduce(x)
        line = test_each_wrapped_call_is_recorded_with_its_caller_and_step.__code__.co_firstlineno + 9
        dist.broadcast(x, src=0)
        dist.barrier()
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        got = read_file(str(tmp_path / "rank-0.trace"))
        assert [(g.seq, g.op, g.numel, g.state, g.step, g.micro, g.by) for g in got] == [
            (1, "all_reduce", 5, "done", 7, 1, ""), (2, "broadcast", 5, "done", 7, 1, ""),
            (3, "barrier", -1, "done", 7, 1, ""), (4, "all_reduce", 5, "issued", 7, 1, "")]
        assert got[0].where == f"test_records.py:{line}" and got[0].group == got[3].group != ""
        assert dist.all_reduce.__wrapped__ is before and recorder.original("all_reduce") is before
    finally:
        recorder.stop()
        recorder.set_position(lambda: (0, 0))
        dist.destroy_process_group()
    assert dist.all_reduce is before


def test_a_skipped_collective_names_the_rank_that_went_ahead():
    records = {0: [rec(0, 56, step=2, state="done"), rec(0, 57, numel=1, where="train.py:42")],
               1: [rec(1, 56, step=2, state="done"), rec(1, 57, numel=1000, step=4, by="DDP", where="train.py:40")]}
    f = analyze.first_divergence(records)
    assert f.kind == "skipped" and f.seq == 57
    assert f.line == ("rank 1 skipped all_reduce #57 (train.py:42, step 3): rank 0 waits in it, rank 1 is already in "
                      "DDP's all_reduce #57 (train.py:40, backward, step 4)")
    assert analyze.cause(records, 0, "") == (f.line, True)  # whichever rank gloo aborted


def test_other_sizes_name_both():
    records = {0: [rec(0, 11, state="done"), rec(0, 12, numel=10, where="train.py:30")],
               1: [rec(1, 11, state="done"), rec(1, 12, numel=20, where="train.py:33")],
               2: [rec(2, 11, state="done"), rec(2, 12, numel=10, where="train.py:30")]}
    assert analyze.explain(records) == ("all_reduce #12 at step 3 got 10 float32 on ranks 0 and 2 (train.py:30) and "
                                        "20 float32 on rank 1 (train.py:33): every rank must pass the same size")


def test_other_ops_and_a_rank_that_never_arrived():
    records = {0: [rec(0, 5, op="all_reduce", where="a.py:1")], 1: [rec(1, 5, op="broadcast", where="a.py:2")]}
    assert analyze.explain(records) == ("the ranks called different collectives as #5: rank 0 in all_reduce #5 "
                                        "(a.py:1, step 3), rank 1 in broadcast #5 (a.py:2, step 3) (code that runs "
                                        "a collective on some ranks only?)")
    records = {0: [rec(0, 4, state="done"), rec(0, 5, by="FSDP", op="all_gather_into_tensor", where="t.py:9")],
               1: [rec(1, 4, state="done", step=2)]}
    f = analyze.first_divergence(records)
    assert f.kind == "missing" and f.missing == [1]
    assert f.line == ("rank 1 did not reach FSDP's all_gather_into_tensor #5 (t.py:9, step 3), where rank 0 waits: "
                      "rank 1's last was all_reduce #4 (train.py:30, step 2)")
    assert analyze.cause(records, 1, "ValueError: boom") == (
        "rank 0 waits in FSDP's all_gather_into_tensor #5 (t.py:9, step 3), which rank 1 did not reach", False)
    assert analyze.cause(records, 1, "CollectiveTimeoutError: rank 1 did not arrive") is None  # said already
    # rank 0 killed while it waited (NCCL's watchdog): rank 1's absence is the cause
    assert analyze.cause(records, 0, "") == (f.line, True)
    # rank 0's own error: where it was, not rank 1's absence
    assert analyze.cause(records, 0, "ValueError: boom") == (
        "rank 0's last collective was FSDP's all_gather_into_tensor #5 (t.py:9, step 3), started", False)


def test_ranks_that_agree_or_lost_their_oldest_records_say_nothing():
    same = {r: [rec(r, 1, state="done"), rec(r, 2)] for r in range(2)}
    assert analyze.first_divergence(same) is None
    # rank 1's ring lost #1 and #2; they agree on what both still hold
    assert analyze.first_divergence({0: [rec(0, k) for k in (1, 2, 3)], 1: [rec(1, 3)]}) is None
    # the earliest divergence of two groups is the cause
    two = {0: [rec(0, 1, group="a", numel=1, t=5), rec(0, 1, group="b", numel=1, t=2)],
           1: [rec(1, 1, group="a", numel=2, t=6), rec(1, 1, group="b", numel=3, t=3)]}
    f = analyze.first_divergence(two)
    assert f.group == "b" and "on process group 'b'" in f.line
    text = analyze.table(same)
    assert text.splitlines()[0].split() == ["rank", "seq", "op", "group", "size", "step", "micro", "state", "by", "where"]
    assert len(text.splitlines()) == 5


def test_doctor_reads_flight_recorder_dumps(tmp_path, monkeypatch):
    """A real Flight Recorder dump (gloo's, torch 2.13: the format NCCL writes on a timeout), and the same
    with one size changed as another rank's: doctor names the collective, both sizes and both lines."""
    import pickle

    from clitools import run_cli

    from paratrain.trace.flight import read_flight_dumps

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(10))
        line = test_doctor_reads_flight_recorder_dumps.__code__.co_firstlineno + 14
        dist.broadcast(torch.ones(3), src=0)
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))
    finally:
        dist.destroy_process_group()
    dump["entries"] = dump["entries"][-2:]  # the recorder is one per process: an earlier test's group is in it too
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(dump))
    dump["entries"][1]["input_sizes"] = [[5]]
    (tmp_path / "nccl_trace_rank_1").write_bytes(pickle.dumps(dump))
    (tmp_path / "notes_2").write_text("not a dump")  # other files are left alone
    got = read_flight_dumps(str(tmp_path))
    assert sorted(got) == [0, 1] and [(r.seq, r.op, r.numel, r.dtype) for r in got[0]] == [
        (1, "all_reduce", 10, "float32"), (2, "broadcast", 3, "float32")]
    assert got[0][1].where == f"test_records.py:{line}" and got[0][1].step == -1
    res = run_cli(["doctor", str(tmp_path)], timeout=60)
    assert res.returncode == 1, res.stderr
    assert res.stdout.splitlines()[1] == (f"doctor: broadcast #2 got 3 float32 on rank 0 (test_records.py:{line}) and "
                                          f"5 float32 on rank 1 (test_records.py:{line}): every rank must pass the "
                                          "same size"), res.stdout
    (tmp_path / "evil_3").write_bytes(pickle.dumps(__import__("collections").OrderedDict()))
    assert 3 not in read_flight_dumps(str(tmp_path))  # a class in the pickle: not read
