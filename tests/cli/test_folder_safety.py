"""``paratrain train`` and its folders (issue 26, items 2 and 3): two runs started at once into one
folder (one trains, the other is refused naming it), the resume of a killed run, a checkpoint folder
that fills up (one line; the previous checkpoint loads) and a read-only ``runs/`` (one line)."""

from __future__ import annotations

import argparse
import csv
import re
import socket
import subprocess
from pathlib import Path

import pytest

from clitools import finish, run_cli, start_cli
from mounts import tmpfs as _tmpfs
from paratrain.checkpoint import load_latest
from paratrain.cli import train as train_cli
from paratrain.env.disk import StorageError

pytestmark = pytest.mark.timeout(240)

TRAIN = ["train", "--no-progress", "--set", "log_every=1"]


def _steps(run: Path) -> list[int]:
    with open(run / "train.csv", newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def _only_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_two_runs_started_together_into_one_folder_one_trains(tmp_path: Path) -> None:
    args = [*TRAIN, "--name", "same", "--max-steps", "30", "--checkpoint-every", "10"]
    slow = {"PARATRAIN_TEST_STEP_SLEEP": "0.2"}  # tests/faults: the winner still trains when the other checks
    procs = [start_cli(args, cwd=tmp_path, **slow), start_cli(args, cwd=tmp_path, **slow)]  # the same second
    done = [finish(p, timeout=200) for p in procs]
    assert sorted(d.returncode for d in done) == [0, 2], [d.stderr[-2000:] for d in done]
    won, lost = (procs[0], done[1]) if done[0].returncode == 0 else (procs[1], done[0])
    line = _only_line(lost.stderr)
    assert re.fullmatch(rf"paratrain train: error: (run|checkpoint) folder 'runs/same(/checkpoints)?' is in use by "
                        rf"another run \(host {re.escape(socket.gethostname())}, PID {won.pid}, started "
                        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\): wait for it to end, or choose another (--name|--checkpoint-dir)"
                        r" \(traceback: .*\)", line), line
    run = tmp_path / "runs" / "same"
    assert _steps(run) == list(range(1, 31))  # one run's rows, each step once
    assert not list(run.glob("error-*"))  # the refused run wrote nothing into the folder
    assert not (run / ".paratrain.lock").exists() and not (run / "checkpoints" / ".paratrain.lock").exists()


def test_the_resume_of_a_killed_run_takes_its_lock_over(tmp_path: Path) -> None:
    args = [*TRAIN, "--name", "killed", "--max-steps", "20", "--checkpoint-every", "5"]
    killed = run_cli(args, timeout=200, cwd=tmp_path, PARATRAIN_TEST_KILL_AT="0:12")  # SIGKILL: no release
    assert killed.returncode == -9, killed.stderr[-2000:]
    lock = tmp_path / "runs" / "killed" / ".paratrain.lock"
    assert lock.exists()
    resumed = run_cli([*args, "--resume"], timeout=200, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"paratrain: warning: run folder 'runs/killed': taking over the lock of a run that ended without "
                     r"releasing it \(host .*, PID \d+, started .*; the PID is gone\)", resumed.stderr), resumed.stderr
    assert "resumed from step 10" in resumed.stdout
    assert _steps(tmp_path / "runs" / "killed") == list(range(1, 21))
    assert not lock.exists()


def test_a_full_checkpoint_folder_is_one_line_and_the_previous_checkpoint_loads(tmp_path: Path) -> None:
    # a checkpoint of the default task is 320 KiB: room for two, not three, and less than two estimated
    with _tmpfs(tmp_path / "small", 720) as folder:
        out = run_cli([*TRAIN, "--max-steps", "30", "--checkpoint-every", "10", "--checkpoint-dir", str(folder),
                       "--log-dir", str(tmp_path / "run")], timeout=200, cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-3000:]
        warning, error = [line for line in out.stderr.splitlines() if line.strip()]
        assert re.fullmatch(rf"paratrain: warning: '{folder}' has [\d.]+ KiB free, less than 2 checkpoints of about "
                            r"[\d.]+ KiB each: .* choose another --checkpoint-dir", warning), warning
        assert re.fullmatch(rf"paratrain train: error: cannot write step-00000030.pt in '{folder}': the disk is full "
                            r"\(needs about [\d.]+ KiB, [\d.]+ KiB free\); the previous checkpoint step-00000020.pt is "
                            r"intact: free space, or choose another checkpoint folder \(traceback: .*\)", error), error
        path, state = load_latest(folder)  # type: ignore[misc]
        assert path.name == "step-00000020.pt" and state["global_step"] == 20
        assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-00000010.pt", "step-00000010.sha256",
                                                           "step-00000020.pt", "step-00000020.sha256"]


def test_a_read_only_runs_folder_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _tmpfs(tmp_path / "ro", 256) as folder:
        (folder / "runs").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        out = run_cli([*TRAIN, "--max-steps", "1"], timeout=120, cwd=folder)
        assert out.returncode == 2
        assert re.fullmatch(rf"paratrain train: error: --log-dir 'runs/\{{name\}}' cannot be written: "
                            rf"'{folder}/runs' is on a read-only filesystem; choose another --log-dir "
                            r"\(traceback: .*\)", _only_line(out.stderr)), out.stderr
        # a worker of another launcher names the run folder itself: one line there too
        monkeypatch.chdir(folder)
        parser = argparse.ArgumentParser()
        train_cli.add_parser(parser.add_subparsers())
        cfg = train_cli.build_config(parser.parse_args(["train", "--max-steps", "1"]))
        with pytest.raises(StorageError, match=rf"^cannot write in '{folder}/runs': the filesystem is read-only "
                                               r"\(.*\): remount it writable, or choose another --log-dir$"):
            train_cli._pick_run(cfg, worker=False)
