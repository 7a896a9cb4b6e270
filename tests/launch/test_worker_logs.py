"""Each worker's output kept in the run folder (``logs/rank-N.log``) as well as on the terminal, in whole
lines (issue 36, item 4): :class:`paratrain.launch.logs.WorkerLogs` on files written by hand, and
``paratrain run --log-dir`` with two real workers."""

from __future__ import annotations

import re

from clitools import run_cli

from paratrain.launch.logs import WorkerLogs


def test_whole_lines_go_to_the_terminal_and_both_streams_to_the_ranks_file(tmp_path, capfdbinary):
    source = tmp_path / "agent" / "run_id" / "attempt_0"
    for local in (0, 1):
        (source / str(local)).mkdir(parents=True)
    out0, err1 = source / "0" / "stdout.log", source / "1" / "stderr.log"
    out0.write_bytes(b"one\ntw")  # a line without its end yet
    err1.write_bytes(b"50%\r")  # a progress bar's piece
    logs = WorkerLogs(str(tmp_path / "agent"), str(tmp_path / "logs"), lambda local: 4 + local, interval_s=0.01)
    logs._read_all(final=False)
    assert capfdbinary.readouterr() == (b"one\n", b"50%\r")
    with open(out0, "ab") as f:
        f.write(b"o\nlast words")  # the worker died before its newline
    (source / "1" / "stdout.log").write_bytes(b"hello\n")
    logs.stop()
    got = capfdbinary.readouterr()
    assert got.out == b"two\nlast words\nhello\n" and got.err == b""
    assert (tmp_path / "logs" / "rank-4.log").read_bytes() == b"one\ntwo\nlast words\n"
    assert (tmp_path / "logs" / "rank-5.log").read_bytes() == b"50%\rhello\n"
    assert logs.path(5) == str(tmp_path / "logs" / "rank-5.log")


CHATTY = """
import os, sys, time
rank = int(os.environ["RANK"])
for i in range(200):
    sys.stdout.write(f"rank {rank} line {i} ")  # a line in two writes: another rank's may come between
    sys.stdout.flush()
    sys.stdout.write("end\\n")
    sys.stdout.flush()
print(f"rank {rank} says goodbye on stderr", file=sys.stderr)
if rank == 1:
    raise ValueError("bad batch")
"""


def test_paratrain_run_keeps_each_ranks_output_and_names_the_file(tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    res = run_cli(["run", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "run"), str(script)], timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 400 and all(re.fullmatch(r"rank [01] line \d+ end", ln) for ln in lines), lines[:5]
    last = res.stderr.strip().splitlines()[-1]
    log = tmp_path / "run" / "logs" / "rank-1.log"
    assert last.startswith("paratrain run: error: worker rank 1 failed (exit code 1)") and last.endswith(f"(output: {log})")
    kept = log.read_text()
    assert "rank 1 line 199 end\n" in kept and "ValueError: bad batch" in kept and "goodbye on stderr" in kept
    assert "rank 0" not in kept


def test_a_rank_started_again_into_the_same_file_is_read_from_its_start(tmp_path, capfdbinary):
    # torchrun's agent keeps the attempt's number when the hosts change: the new workers' file is truncated
    out = tmp_path / "agent" / "run_id" / "attempt_0" / "0" / "stdout.log"
    out.parent.mkdir(parents=True)
    out.write_bytes(b"world of one: a long first line\n")
    logs = WorkerLogs(str(tmp_path / "agent"), str(tmp_path / "logs"))
    logs._read_all(final=False)
    out.write_bytes(b"world of two\n")
    logs._read_all(final=False)
    out.write_bytes(b"world of two\nand more than the first attempt wrote, before the launcher looked\n")
    logs.stop()
    assert capfdbinary.readouterr().out == (b"world of one: a long first line\nworld of two\nand more than the first "
                                            b"attempt wrote, before the launcher looked\n")
