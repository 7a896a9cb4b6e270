"""Preemption (issue 26): a stop signal (SIGTERM, SIGUSR1) reaches every worker through the launcher;
the workers finish the step, save at the same step, print one line and exit 75; ``--resume`` then
ends with the uninterrupted run's weights, bit for bit. A save past the grace period leaves the
previous checkpoint the newest."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clitools import cli_env, run_cli
from paratrain.checkpoint import list_checkpoints, load_latest
from paratrain.env import preemption

pytestmark = pytest.mark.timeout(400)

STEPS = 30
TRAIN = ["train", "--strategy", "ddp", "--nproc-per-node", "2", "--max-steps", str(STEPS), "--global-batch", "32",
         "--no-progress"]
LOOP = "tests/scripts/preempt_loop.py"


def _weights(run: Path) -> dict:
    return torch.load(list_checkpoints(run / "checkpoints")[-1], weights_only=True)["model"]


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref")
    r = run_cli([*TRAIN, "--log-dir", str(run), "--checkpoint-dir", str(run / "checkpoints")], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return _weights(run)


# One signal per path, crossed: both signals go through one handler (the tests below check that each is forwarded
# and polled), and the lab's Slurm test sends a real USR1. Each case here is two runs of a CLI.
@pytest.mark.parametrize("sig", ["SIGTERM"])
def test_paratrain_train_saves_on_a_stop_signal_and_resumes_bit_exact(tmp_path, uninterrupted, sig):
    run = tmp_path / "run"
    stopped = run_cli([*TRAIN, "--log-dir", str(run)], timeout=240, PARATRAIN_TEST_SIGNAL_AT=f"5:{sig}")
    assert stopped.returncode == preemption.PREEMPTED_EXIT_CODE, stopped.stderr[-3000:]
    step = _stopped_at(stopped.stdout, 5, STEPS)
    assert "Traceback" not in stopped.stderr and "error" not in stopped.stderr, stopped.stderr
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == [f"step-{step:08d}.pt"]
    resumed = run_cli([*TRAIN, "--resume", str(run)], timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {step}" in resumed.stdout
    _assert_equal(_weights(run), uninterrupted)


def _stopped_at(stdout: str, signalled: int, steps: int) -> int:
    """The step of the one ``preempted at step N`` line: the first boundary after the signal reached
    the workers (the launcher forwards it while they go on), so never before the step it was sent after."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("preempted")]
    assert len(lines) == 1, stdout
    step = int(lines[0].split()[3].rstrip(":"))
    assert signalled <= step < steps and lines[0] == (
        f"preempted at step {step}: checkpoint saved; continue with --resume"), stdout
    return step


def _loop(out: Path, ckpt: Path, resume: bool, sig: str = "none", at: int = 0, timeout: float = 240):
    return run_cli(["run", "--nproc-per-node", "2", LOOP, str(out), str(ckpt), "1" if resume else "0", sig, str(at)],
                   timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted_loop(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("loop-ref")
    ref = _loop(tmp / "ref.pt", tmp / "ckpt", False)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return torch.load(tmp / "ref.pt")


@pytest.mark.parametrize("sig", ["SIGUSR1"])  # SIGTERM: paratrain train's case above
def test_own_loop_stops_through_should_stop_and_resumes_bit_exact(tmp_path, uninterrupted_loop, sig):
    stopped = _loop(tmp_path / "out.pt", tmp_path / "ckpt", False, sig, 5)
    assert stopped.returncode == preemption.PREEMPTED_EXIT_CODE, stopped.stderr[-3000:]
    step = _stopped_at(stopped.stdout, 5, 60)
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == [f"step-{step:08d}.pt"]
    assert not (tmp_path / "out.pt").exists()  # the script did not go on as if it had finished
    resumed = _loop(tmp_path / "out.pt", tmp_path / "ckpt", True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_equal(torch.load(tmp_path / "out.pt"), uninterrupted_loop)


@pytest.mark.waits
def test_a_save_past_the_grace_period_leaves_the_previous_checkpoint_newest(tmp_path):
    """The save after the signal at step 5 takes 60 s, the grace is 3 s: the workers end
    without it; step 4 stays the newest complete checkpoint and loads."""
    run = tmp_path / "run"
    r = run_cli([*TRAIN, "--log-dir", str(run), "--checkpoint-every", "4", "--preempt-grace-s", "3"], timeout=240,
                PARATRAIN_TEST_SIGNAL_AT="5:SIGTERM", PARATRAIN_TEST_SLOW_SAVE_AFTER="4:60")
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-3000:]
    assert re.search(r"preempted( at step \d+)?: no checkpoint completed within 3 s of the signal", r.stderr), r.stderr
    ckpts = run / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step-00000004.pt"]
    assert (ckpts / "latest").read_text() == "step-00000004.pt"
    assert any(".pt.tmp-" in p.name for p in ckpts.iterdir())  # the half-done save: never listed, never loaded
    path, state = load_latest(ckpts)
    assert path.name == "step-00000004.pt" and state["global_step"] == 4


_NOT_ASKING = """
import os, signal, time, paratrain
pt = paratrain.Parallel()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
"""


def test_a_script_that_never_asks_is_stopped_by_the_signal_as_before():
    """Without ``pt.should_stop`` in the loop a SIGTERM ends the process as it did: nothing would stop it."""
    r = subprocess.run([sys.executable, "-c", _NOT_ASKING], env=cli_env(), capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGTERM, r.stderr[-2000:]


def test_the_agent_forwards_the_stop_signals_and_waits_for_the_grace(monkeypatch, tmp_path):
    for var in (preemption.SIGNALS_ENV, preemption.GRACE_ENV, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(preemption.GRACE_ENV, "90")
    flags = preemption.agent_flags([], str(tmp_path / "r"))
    assert flags == ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=105"]
    assert preemption.stop_signals() == [signal.SIGTERM, signal.SIGUSR1]
    monkeypatch.delenv(preemption.SIGNALS_ENV)
    assert preemption.agent_flags(["--signals-to-handle=SIGINT,SIGUSR2", "--shutdown-timeout=5"], str(tmp_path)) == []
    assert preemption.stop_signals() == [signal.SIGUSR2]  # the user's list; Ctrl-C stays an interrupt
    monkeypatch.setenv(preemption.GRACE_ENV, "0")
    with pytest.raises(ValueError, match="PARATRAIN_PREEMPT_GRACE_S='0' must be a positive number"):
        preemption.grace_s()
    os.environ.pop(preemption.REPORT_ENV, None)


def test_the_flag_is_agreed_once_per_step_and_the_save_runs_once(monkeypatch, capsys):
    """In one process, with the all-reduce played by a function: a signal only flags; the step every
    rank agrees on saves once and prints one line; a rank that learnt it from a peer exits 0."""
    monkeypatch.setenv(preemption.GRACE_ENV, "600")
    monkeypatch.delenv(preemption.SIGNALS_ENV, raising=False)
    monkeypatch.delenv(preemption.REPORT_ENV, raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    stop, calls, saves = preemption.stop_signal(main=True), [], []
    stop.save = lambda: saves.append(1)

    def any_rank(flag, peer=False):
        calls.append(flag)
        return flag or peer

    try:
        assert not stop.check(1, 0, any_rank) and not stop.check(1, 0, any_rank)  # once per step
        os.kill(os.getpid(), signal.SIGUSR1)  # polled now: only the flag is set
        assert not stop.check(2, 1, any_rank)  # mid-accumulation: no collective
        assert stop.check(2, 0, any_rank) and stop.check(2, 0, any_rank) and stop.check(3, 0, any_rank)
        assert calls == [False, True, True] and saves == [1] and stop.exit_code == preemption.PREEMPTED_EXIT_CODE
        assert capsys.readouterr().out == "preempted at step 2: checkpoint saved; continue with --resume\n"
        stop = preemption.stop_signal(main=False)  # a new run; this rank gets no signal, a peer did
        assert stop.check(5, 0, lambda flag: any_rank(flag, peer=True)) and stop.exit_code == 0
        assert capsys.readouterr().out == ""  # only the main process prints
    finally:
        preemption.stop_signal(main=True)
