"""One run per folder (issue 26, item 2): ``.paratrain.lock`` held with ``flock`` by the run that owns
the folder; another process is refused naming its host and PID, a dead holder's file is taken
over with a warning, a file left by another host is refused, our own launcher's lock is ours."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from paratrain.env import lock
from paratrain.env.lock import LOCK_FILE, FolderInUseError, lock_folder

pytestmark = pytest.mark.timeout(120)

HOST = socket.gethostname()
JOB_VARS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PMIX_NAMESPACE", "PARATRAIN_AGENT_PID")


@pytest.fixture(autouse=True)
def no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in JOB_VARS:
        monkeypatch.delenv(name, raising=False)


def _holder(folder: Path) -> subprocess.Popen:
    """Another process that holds ``folder`` until it is killed (it prints ``held`` once it does)."""
    code = textwrap.dedent(f"""
        import sys, time
        from paratrain.env.lock import lock_folder
        lock_folder({str(folder)!r})
        print("held", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _end(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_another_process_holding_the_folder_is_named_in_one_line(tmp_path: Path) -> None:
    proc = _holder(tmp_path / "run")
    try:
        with pytest.raises(FolderInUseError) as e:
            lock_folder(tmp_path / "run", "run folder", "--name")
        line = str(e.value)
        assert "\n" not in line
        assert line.startswith(f"run folder {str(tmp_path / 'run')!r} is in use by another run (host {HOST}, "
                               f"PID {proc.pid}, started ")
        assert line.endswith("): wait for it to end, or choose another --name")
    finally:
        _end(proc)


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path: Path) -> None:
    proc = _holder(tmp_path)
    _end(proc)  # SIGKILL: no release, the file stays with its PID in it
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == proc.pid
    with pytest.warns(UserWarning, match=rf"taking over the lock of a run that ended without releasing it \(host "
                                         rf"{HOST}, PID {proc.pid}, started .*; the PID is gone\)"):
        held = lock_folder(tmp_path)
    assert held is not None
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    held.release()
    assert not (tmp_path / LOCK_FILE).exists()  # a run that ends leaves no lock behind


def test_a_lock_left_on_another_host_is_refused_unless_it_is_this_jobs(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    left = {"host": "node-7", "pid": 4242, "started": time.time(), "job": "slurm-99"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(left))
    with pytest.raises(FolderInUseError, match=r"is in use by a run on another host \(host node-7, PID 4242, started "
                                               r".*\), which cannot be checked from here: choose another folder, or "
                                               r"remove '.*\.paratrain\.lock' if that run has ended$"):
        lock_folder(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "99")  # the same job, requeued onto this host: its own folder
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        held = lock_folder(tmp_path)
    assert held is not None and json.loads((tmp_path / LOCK_FILE).read_text())["job"] == "slurm-99"
    held.release()


def test_holds_in_one_process_are_shared_and_counted(tmp_path: Path) -> None:
    first = lock_folder(tmp_path / "new")
    second = lock_folder(tmp_path / "new")
    assert first is second and first is not None
    first.release()
    assert (tmp_path / "new" / LOCK_FILE).exists()  # still held once
    second.release()
    assert not (tmp_path / "new").exists()  # made for the lock and left empty: removed with it


def test_the_workers_of_the_launcher_that_holds_the_folder_use_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    proc = _holder(tmp_path)
    try:
        monkeypatch.setenv("PARATRAIN_AGENT_PID", str(proc.pid))  # what `paratrain train` gives its workers
        assert lock_folder(tmp_path) is None  # the launcher's: no hold of its own, no error
        monkeypatch.setenv("PARATRAIN_AGENT_PID", "1")
        with pytest.raises(FolderInUseError):
            lock_folder(tmp_path)
    finally:
        _end(proc)


def test_parallel_in_a_users_loop_holds_its_folders(tmp_path: Path) -> None:
    import torch

    import paratrain

    proc = _holder(tmp_path / "ckpt")
    try:
        with pytest.raises(FolderInUseError, match=r"^log_dir '.*ckpt' is in use by another run"):
            paratrain.Parallel(strategy="single", global_batch=4, log_dir=str(tmp_path / "ckpt"), log_to="csv")
        pt = paratrain.Parallel(strategy="single", global_batch=4, log_dir=str(tmp_path / "logs"), log_to="csv")
        assert json.loads((tmp_path / "logs" / LOCK_FILE).read_text())["pid"] == os.getpid()
        model = torch.nn.Linear(2, 2)
        model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(FolderInUseError, match=rf"^checkpoint folder '.*ckpt' is in use by another run \(host "
                                                   rf"{HOST}, PID {proc.pid}, "):
            pt.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
        pt.save_checkpoint(str(tmp_path / "mine"), model, opt)
        assert (tmp_path / "mine" / LOCK_FILE).exists()
        pt.close()
        assert not (tmp_path / "logs" / LOCK_FILE).exists() and not (tmp_path / "mine" / LOCK_FILE).exists()
    finally:
        _end(proc)
    # none of this test's folders is still held (another test of the same worker may hold its own)
    assert not [k for k in lock._HELD if k.startswith(str(tmp_path))], lock._HELD
