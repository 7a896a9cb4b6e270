"""What the launcher says when workers fail or restart (``paratrain.launch.torchrun``): the rank
that caused it, once, and one line per restart. Real torchrun agents and gloo workers, each CLI
call in its own process group with a hard limit (``clitools``)."""

from __future__ import annotations

import itertools
import json
import signal
from pathlib import Path

import pytest

from clitools import run_cli
from pace import scaled
from paratrain.launch.reports import failure_line as _failure_line

pytestmark = pytest.mark.timeout(240)  # backstop; run_cli's own limits are shorter


# --- the right culprit, once (issue 26, item 4) --------------------------------------------------

def _Failed(failures: dict):
    """The ``ChildFailedError`` the agent raises: ``failures`` maps rank -> ProcessFailure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    return ChildFailedError("script.py", failures)


_files = itertools.count()


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None, timestamp: int = 100):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error-{rank}-{next(_files)}.json"
    if message is not None:
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "", "timestamp": str(timestamp)}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_a_rank_that_only_lost_its_peer_is_not_named(tmp_path):
    # rank 0 recorded gloo's error first (its own @record, same second), rank 1 raised: rank 1 alone
    lost = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"
    failures = {0: _failure(tmp_path, 0, 1, lost), 1: _failure(tmp_path, 1, 1, "ValueError: bad batch")}
    assert _failure_line(_Failed(failures), "x:") == ("x: worker rank 1 failed (exit code 1): ValueError: bad batch", 1)
    # paratrain's own line for it, and the agent's SIGTERM to the rank still running: not named either
    failures = {1: _failure(tmp_path, 1, 3, None), 0: _failure(tmp_path, 0, -signal.SIGTERM, None)}
    assert _failure_line(_Failed(failures), "x:") == ("x: worker rank 1 failed (exit code 3)", 3)
    failures = {0: _failure(tmp_path, 0, 1, "PeerLostError: rank 0 lost its connection to a peer", timestamp=99),
                1: _failure(tmp_path, 1, -signal.SIGKILL, None)}
    assert _failure_line(_Failed(failures), "x:") == ("x: worker rank 1 failed (killed by SIGKILL)", 137)


def test_a_rank_stopped_by_the_agent_after_it_recorded_its_error_ended_by_that_error(tmp_path):
    # on a busy machine rank 0 was still in its exit handlers when rank 1's failure made the agent SIGTERM it
    timeout = "CollectiveTimeoutError: rank 1 did not arrive at a collective (broadcast) for 5 s (timeout_s)"
    failures = {0: _failure(tmp_path, 0, -signal.SIGTERM, timeout, timestamp=99),
                1: _failure(tmp_path, 1, 1, "CollectiveTimeoutError: rank 0 did not arrive")}
    assert _failure_line(_Failed(failures), "x:") == ("x: rank 1 did not arrive at a collective (broadcast) for 5 s "
                                                      "(timeout_s)", 1)
    failures = {0: _failure(tmp_path, 0, -signal.SIGTERM, "ValueError: bad batch")}
    assert _failure_line(_Failed(failures), "x:") == ("x: worker rank 0 failed (exit code 1): ValueError: bad batch", 1)


def test_ranks_that_each_failed_on_their_own_are_all_named(tmp_path):
    failures = {1: _failure(tmp_path, 1, 1, "KeyError: 'a'", timestamp=101), 0: _failure(tmp_path, 0, 1, "KeyError: 'b'"),
                2: _failure(tmp_path, 2, -signal.SIGTERM, None)}
    assert _failure_line(_Failed(failures), "x:")[0] == "x: worker ranks 0, 1 (first: rank 0) failed (exit code 1): KeyError: 'b'"
    # an outside SIGTERM (no other failure): the rank the agent saw end first
    failures = {1: _failure(tmp_path, 1, -signal.SIGTERM, None), 0: _failure(tmp_path, 0, -signal.SIGTERM, None)}
    assert _failure_line(_Failed(failures), "x:")[0] == "x: worker rank 1 failed (killed by SIGTERM)"


RAISES_ON_RANK_1 = """
import torch
import paratrain

pt = paratrain.Parallel(strategy="ddp", global_batch=2, timeout_s=30)
if pt.rank == 1:
    raise ValueError("bad batch on rank 1")
pt.reduce(torch.tensor(1.0), "sum")  # rank 0 waits here and loses its peer
pt.close()
"""


def test_only_the_rank_that_raised_prints_a_traceback_and_is_named(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(RAISES_ON_RANK_1)
    res = run_cli(["run", "--nproc-per-node", "2", str(script)], timeout=120)
    assert res.returncode == 1, res.stderr[-3000:]
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr[-3000:]
    assert "[rank1]: ValueError: bad batch on rank 1" in res.stderr
    assert "Connection closed by peer" not in res.stderr and "Connection reset by peer" not in res.stderr, res.stderr
    lost = [ln for ln in res.stderr.splitlines() if "rank 0" in ln]  # rank 0 only lost its peer: one line at most
    assert len(lost) <= 1 and all("PeerLostError: rank 0 lost its connection" in ln for ln in lost), lost
    assert res.stderr.strip().splitlines()[-1] == (
        "paratrain run: error: worker rank 1 failed (exit code 1): ValueError: bad batch on rank 1")


MAIN_PROCESS_ONLY_SAVE = """
import sys
import time

import torch
import paratrain

pt = paratrain.Parallel(strategy="ddp", global_batch=2, timeout_s=TIMEOUT_S)
net = torch.nn.Linear(2, 1)
model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
for step in range(3):
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.zero_grad()
    if step == 1 and pt.rank == LATE_RANK:
        time.sleep(LATE_S)  # this rank enters its next collective later: the other times out first
    if step == 1 and pt.is_main_process:  # the classic mistake: save_checkpoint is a collective
        pt.save_checkpoint(sys.argv[1], model, opt)
pt.close()
"""


@pytest.mark.waits
@pytest.mark.parametrize("late_rank", [0, 1])
def test_a_collective_called_on_the_main_process_only_names_the_ranks_that_never_arrived(tmp_path, late_rank):
    """Rank 0 waits in save_checkpoint, rank 1 in the next step's gradient reduction: both time out.
    The line names rank 1 (it never arrived at save_checkpoint), with the hint, once, whichever
    rank entered its collective seconds later (writing files first, a busy machine) and timed out last."""
    timeout_s = round(scaled(5))  # a slow or busy machine's ranks may fall further apart before the mistake
    script = tmp_path / "main_only.py"
    late_s = min(5, max(2, timeout_s / 5)) + 1  # more than the grace the first rank gives the others (explain_timeout)
    script.write_text(MAIN_PROCESS_ONLY_SAVE.replace("TIMEOUT_S", str(timeout_s)).replace("LATE_RANK", str(late_rank))
                      .replace("LATE_S", str(late_s)))
    res = run_cli(["run", "--nproc-per-node", "2", str(script), str(tmp_path / "ckpt")], timeout=150)
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("paratrain run: error: rank 1 did not arrive at a collective (") and \
        f"in Parallel.save_checkpoint) for {timeout_s} s (timeout_s): it waited in a collective (the gradient reduction in " \
        "backward) instead; rank 0 waited for it" in last, res.stderr[-3000:]
    assert last.endswith("(Parallel.save_checkpoint is a collective: does every rank call it, not the main process only?)")
    assert "Traceback" not in res.stderr, res.stderr[-3000:]  # neither rank raised: each only waited
    assert len([ln for ln in res.stderr.splitlines() if ln.startswith("paratrain: CollectiveTimeoutError")]) == 1


# --- a restart is a line (issue 26, item 6) ------------------------------------------------------

KILLED_ONCE = """
import os
import signal
import sys

import torch
import paratrain

pt = paratrain.Parallel(strategy="ddp", global_batch=2)
if pt.rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer's way
line = f"rank {pt.rank} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}: {pt.reduce(torch.tensor(1.0), 'sum').item()}"
os.write(1, (line + "\\n").encode())  # one write: the two ranks share the launcher's stdout
pt.close()
"""


def test_paratrain_run_says_which_rank_died_and_which_restart_begins(tmp_path):
    script = tmp_path / "killed_once.py"
    script.write_text(KILLED_ONCE)
    res = run_cli(["run", "--nproc-per-node", "2", "--max-restarts", "2", str(script)], timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(ln for ln in res.stdout.splitlines() if "attempt" in ln) == ["rank 0 attempt 1: 2.0",
                                                                              "rank 1 attempt 1: 2.0"]
    said = [ln for ln in res.stderr.splitlines() if "restart" in ln]
    assert said == ["paratrain: worker rank 1 died (SIGKILL); restart 1/2"], res.stderr[-3000:]


def test_paratrain_train_names_the_checkpoint_a_restart_continues_from(tmp_path):
    res = run_cli(["train", "--strategy", "ddp", "--nproc-per-node", "2", "--max-steps", "6", "--checkpoint-every",
                   "4", "--max-restarts", "2", "--no-progress", "--log-dir", str(tmp_path)], timeout=200,
                  PARATRAIN_TEST_KILL_AT="1:5")
    assert res.returncode == 0, res.stderr[-3000:]
    said = [ln for ln in res.stderr.splitlines() if "restart" in ln]
    assert said == ["paratrain: worker rank 1 died (SIGKILL); restart 1/2 from the checkpoint at step 4"], res.stderr[-3000:]
    assert "resumed from step 4" in res.stdout


# --- frozen or alive elsewhere: the heartbeat tells them apart (paratrain.env.heartbeat) ---------

MISSING_IN_A_CALL = """
import os
import signal
import time

import torch
import paratrain

pt = paratrain.Parallel(strategy="ddp", global_batch=2, timeout_s=TIMEOUT_S)
pt.reduce(torch.ones(1))  # every rank beats by now
if pt.rank == 1:
    if "FAULT" == "STOP":
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its heartbeat stops too
    time.sleep(3600)  # alive but elsewhere (a long computation)
pt.reduce(torch.ones(1))  # rank 0 waits here, in a collective of Parallel's
pt.close()
"""


@pytest.mark.parametrize("fault", ["STOP", "SLEEP"])
def test_a_frozen_rank_is_named_at_once_and_an_alive_one_is_waited_for(tmp_path, fault):
    """Rank 0 times out in ``Parallel.reduce``; rank 1 never comes. Frozen (as a host the network lost), it is
    named after the grace, with no hint of a main-process-only mistake; alive elsewhere (it may time out in
    another collective), rank 0 gives it ``timeout_s`` more, and the line carries the hint."""
    import time

    timeout_s = 6
    script = tmp_path / "missing.py"
    script.write_text(MISSING_IN_A_CALL.replace("TIMEOUT_S", str(timeout_s)).replace("FAULT", fault))
    t0 = time.monotonic()
    # fresh: a frozen worker forked from the test's zygote is not the agent's child, which then waits 30 s to kill it
    res = run_cli(["run", "--nproc-per-node", "2", str(script)], timeout=150, fresh=fault == "STOP")
    took = time.monotonic() - t0
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and last.startswith(
        "paratrain run: error: rank 1 did not arrive at a collective (all_reduce in Parallel.reduce) for 6 s "
        "(timeout_s): "), res.stderr[-3000:]
    if fault == "STOP":
        assert "frozen, gone or unreachable (no heartbeat in the job's store); rank 0 waited for it" in last, last
        assert "main process only" not in last
        # not the timeout_s more that an alive rank gets (the product's terms, and an allowance for the machine)
        assert took <= timeout_s + 2 + scaled(10), f"{took:.1f}s"
    else:
        assert "(timeout_s): alive (it beats in the job's store) but busy elsewhere; rank 0 waited for it" in last, last
        assert last.endswith("(Parallel.reduce is a collective: does every rank call it, not the main process only?)")
        # waited the grace and timeout_s more (explain_timeout) for rank 1 to say where it waits
        assert took >= timeout_s + 2 + timeout_s, f"{took:.1f}s"
    print(f"{fault}: {took:.1f}s\n{last}")
