"""Reliability: what happens to a run when things go wrong around it (real processes, hard limits)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from clitools import killpg, run_cli, start_cli
from pace import scaled

pytestmark = pytest.mark.timeout(120)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_LOOPBACK = ("0100007F", "00000000000000000000000001000000")  # 127.0.0.1 and ::1 as /proc/net/tcp{,6} spell them


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    """(address as /proc/net/tcp spells it, port) of every listening TCP socket of ``pids``."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addr, port = fields[1].split(":")
                out.append((addr, int(port, 16)))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (Linux)")
def test_stores_for_one_node_listen_on_loopback_only() -> None:
    """rank 0's store (through init's master_listen_fd) and an RPC rendezvous (store_init_method)."""
    from datetime import timedelta

    import torch.distributed as dist

    from paratrain.env.process import loopback_store, store_init_method
    from paratrain.launch.spawn import free_port

    store = loopback_store("localhost", free_port(), 0, 1, timedelta(seconds=30))
    store.set("k", "v")
    rpc_store, _, _ = next(dist.rendezvous(store_init_method("127.0.0.1", free_port()), rank=0, world_size=1))
    ports = {store.underlying_store.port, rpc_store.port}  # the group's keys under a prefix of their own
    found = [(addr, port) for addr, port in _listening([os.getpid()]) if port in ports]
    assert sorted(found) == sorted(("0100007F", port) for port in ports)
    assert loopback_store("10.1.2.3", 1, 0, 2, timedelta(seconds=1)) is None  # several nodes: torch's env://
    assert store_init_method("10.1.2.3", 7) == "tcp://10.1.2.3:7"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (Linux)")
def test_workers_stop_when_their_agent_is_killed(tmp_path: Path) -> None:
    """SIGKILL the torchrun agent (as an OOM kill would): its workers must not train on."""
    proc = start_cli(["train", "--strategy", "ddp", "--nproc-per-node", "2", "--epochs", "1000", "--no-progress",
                      "--log-dir", str(tmp_path), "--checkpoint-every", "5"])
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while time.monotonic() < deadline and not (tmp_path / "checkpoints" / "latest").exists():
            time.sleep(0.2)  # training has started once the first checkpoint is there (the folder: at the start)
        # the workers fork from the forkserver that the agent started (paratrain.launch.forkserver)
        workers = [w for server in _children(proc.pid) for w in _children(server)]
        assert len(workers) == 2, f"expected 2 workers under the agent's forkserver, found {workers}"
        # A one-node job listens on loopback only: the agent (its rendezvous is a FileStore) not at
        # all, rank 0's process-group store and gloo on 127.0.0.1.
        listening = _listening([proc.pid, *workers])
        assert listening and all(addr in _LOOPBACK for addr, _ in listening), listening
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers), "workers outlived their agent"
    finally:
        killpg(proc)


def test_unresolvable_master_address_fails_at_once() -> None:
    start = time.monotonic()
    res = run_cli(["train", "--strategy", "ddp", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr",
                   "no-such-host.invalid", "--no-progress", "--log-dir", "none"], timeout=60)
    assert res.returncode == 2 and time.monotonic() - start < 30
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "'no-such-host.invalid' does not resolve" in lines[0], res.stderr


@pytest.mark.parametrize("args, needle", [
    (["--backend", "pigeon"], "backend 'pigeon' is unknown"),
    (["--backend", "nccl"], "backend 'nccl' needs CUDA devices"),
    (["--strategy", "ddp", "--nproc-per-node", "2", "--backend", "nccl"], "backend 'nccl' needs CUDA devices"),
    (["--lr", "nan"], "lr nan must be a positive finite number"),
    (["--lr", "-1"], "lr -1.0 must be a positive finite number"),
])
def test_bad_values_fail_before_any_worker_starts(args: list[str], needle: str) -> None:
    res = run_cli(["train", "--no-progress", "--log-dir", "none", "--max-steps", "1", *args], timeout=60)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("paratrain train: error:") and needle in lines[0], res.stderr


# --- non-finite training stops ---------------------------------------------------------------

def _one_error_line(res, needle: str) -> str:
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr[-3000:]
    return lines[0]


def test_loss_window_stops_after_k_nonfinite_steps_in_a_row() -> None:
    """The stop rule on its own: k non-finite losses in a row stop, fewer do not (one process)."""
    import math

    import torch

    import paratrain
    from paratrain.loop.guard import LossWindow, NonFiniteLossError

    pt = paratrain.Parallel(strategy="single", global_batch=4)
    model = torch.nn.Linear(2, 2)
    window = LossWindow(pt, size=10, limit=3, checkpoints=True)
    nan = math.nan
    for loss in (1.0, nan, nan, 2.0, math.inf, nan):  # two runs of 2 and 2: not yet
        window.add(torch.tensor(loss))
        pt.global_step += 1
    window.mean()
    window.check()
    assert not window.safe_to_save(model)  # the latest step's loss is NaN: no checkpoint of it
    window.add(torch.tensor(nan))
    pt.global_step += 1
    with pytest.raises(NonFiniteLossError, match="3 optimizer steps in a row since step 5 .*after step 4"):
        window.safe_to_save(model)  # checked before a checkpoint, not only at log lines
    with torch.no_grad():
        model.weight[0, 0] = math.inf
    fresh = LossWindow(pt, size=10, limit=3)
    with pytest.raises(NonFiniteLossError, match="weights are NaN or inf"):
        fresh.finish(model)


def test_diverging_run_stops_in_one_line_and_keeps_only_finite_checkpoints(tmp_path: Path) -> None:
    """--lr 1e9 makes the loss NaN: one line, exit 2, and every checkpoint on disk is finite."""
    import torch

    from paratrain.checkpoint import list_checkpoints, load_file

    res = run_cli(["train", "--strategy", "ddp", "--nproc-per-node", "2", "--lr", "1e9", "--max-steps", "40",
                   "--checkpoint-every", "1", "--set", "max_nonfinite_steps=2", "--no-progress", "--log-dir",
                   str(tmp_path)], timeout=100)
    assert res.returncode == 2
    line = _one_error_line(res, "--clip-grad-norm")
    assert "weights are NaN or inf" in line or "in a row since step" in line, line
    saved = list_checkpoints(tmp_path / "checkpoints")
    assert saved, "the steps before the NaN were checkpointed"
    for path in saved:
        weights = load_file(path)["model"]
        assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point()), path
    assert not (tmp_path / "result.json").exists()


# --- results are never lost ------------------------------------------------------------------

def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_mlp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from paratrain.cli.main import main

    folder = tmp_path_factory.mktemp("mlp-run")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PARATRAIN_ERROR_DIR", str(folder))  # main sets it for its run: not for the whole session
        assert main(["train", "--max-steps", "2", "--checkpoint-every", "1", "--no-progress", "--log-dir",
                     str(folder)]) == 0
    return folder


def test_resume_of_a_finished_run_changes_nothing(finished_mlp_run: Path) -> None:
    before = _files(finished_mlp_run)
    again = run_cli(["train", "--max-steps", "2", "--checkpoint-every", "1", "--no-progress", "--log-dir",
                     str(finished_mlp_run), "--resume"], timeout=60)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines() == [
        f"paratrain: this run already finished at step 2; {finished_mlp_run / 'result.json'} is kept as it is "
        "(raise --epochs or --max-steps to train on)"], again.stdout
    assert _files(finished_mlp_run) == before  # not one byte or timestamp changed


@pytest.mark.waits
@pytest.mark.timeout(200)
def test_restart_after_the_final_checkpoint_finishes_the_run(tmp_path: Path) -> None:
    """A worker killed after the last checkpoint: the restarted group evaluates and writes a full
    result (the train loss comes from the checkpoint), never train_loss NaN / test_accuracy null.
    The killed worker is rank 0, the one that writes the checkpoint: it dies after its save returned,
    so the checkpoint is whole (rank 1 could die while rank 0 still wrote it, as a busy machine showed)."""
    res = run_cli(["train", "--strategy", "ddp", "--nproc-per-node", "2", "--max-steps", "8", "--checkpoint-every",
                   "4", "--max-restarts", "1", "--no-progress", "--log-dir", str(tmp_path)], timeout=150,
                  PARATRAIN_TEST_KILL_AT="0:8")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from step 8" in res.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    logged = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert result["resumed_from_step"] == 8 and result["steps"] == 8
    assert result["train_loss"] == logged[-1]["loss"] and logged[-1]["step"] == 8  # the first attempt's
    assert result["test_accuracy"] is not None and result["test_count"] == 359


def test_summary_files_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from paratrain.loop.logging import RunLogger

    logger = RunLogger(str(tmp_path))
    logger.write_json("result.json", {"steps": 1})

    def crash(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        logger.write_json("result.json", {"steps": 2})
    assert json.loads((tmp_path / "result.json").read_text()) == {"steps": 1}  # the old one, whole
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # and no temporary file left


# --- bench checks its names before any cell runs ---------------------------------------------

@pytest.mark.waits
def test_bench_rejects_bad_names_at_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from paratrain.cli.main import main

    start = time.monotonic()
    res = run_cli(["bench", "--no-progress", "--out", str(tmp_path), "--strategies", "single,warp"], timeout=60)
    assert res.returncode == 2 and time.monotonic() - start < 30
    assert _one_error_line(res, "strategy 'warp' is unknown").startswith("paratrain bench: error:")
    assert not any(tmp_path.iterdir())  # no cell ran, nothing written
    for args, needle in ((["--precisions", "fp7"], "precision 'fp7' is unknown"),
                         (["--comm-hooks", "none,zip"], "comm hook 'zip' is unknown"),
                         (["--world-sizes", "1,0"], "world sizes [1, 0] must be positive"),
                         (["--world-sizes", "two"], "'two' is not a comma-separated list of int")):
        try:
            code = main(["bench", "--no-progress", "--out", str(tmp_path), *args])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and [ln for ln in err.splitlines() if ln] == [err.strip()] and needle in err, err
    assert not any(tmp_path.iterdir())


# --- hangs: who did not arrive, and how soon the job ends --------------------------------------

@pytest.mark.waits
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (Linux)")
@pytest.mark.parametrize("fault", ["HANG", "STOP"])  # rank 1 sleeps before a collective / is frozen (SIGSTOP)
def test_a_rank_that_does_not_arrive_is_named_and_ends_the_job_within_timeout_plus_15s(
        tmp_path: Path, fault: str) -> None:
    timeout_s = 5
    proc = start_cli(["train", "--strategy", "ddp", "--nproc-per-node", "2", "--max-steps", "400", "--no-progress",
                      "--log-dir", str(tmp_path), "--set", f"parallel.timeout_s={timeout_s}"],
                     **{f"PARATRAIN_TEST_{fault}_AT": "1:3"})
    try:
        header = proc.stdout.readline()  # rank 0's layout line: training starts, the fault fires at step 3
        started = time.monotonic()
        _, err = proc.communicate(timeout=timeout_s + scaled(60))
        ended = time.monotonic() - started
    finally:
        killpg(proc)
    assert header.startswith("paratrain: ddp on 2 process(es)"), header
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("paratrain: OMP_NUM_THREADS")]
    assert proc.returncode == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("paratrain train: error: rank 1 did not arrive at a collective"), lines[0]
    assert "rank 0 waited for it" in lines[0]
    if fault == "HANG":  # asleep, but its heartbeat goes on (paratrain.env.heartbeat)
        assert "hung: alive (it beats in the job's store), but it neither arrived nor timed out elsewhere" in lines[0]
    # the promise is timeout_s plus what the launcher needs to see it and stop the job, which a slower machine stretches
    assert ended <= timeout_s + scaled(15), f"the job took {ended:.1f}s to end after the fault (timeout_s={timeout_s})"


@pytest.mark.waits
def test_a_rank_that_never_starts_is_one_line_at_start_up(tmp_path: Path) -> None:
    """Rank 0 of a world of 2 whose rank 1 never starts: after timeout_s, one line saying the group
    could not form, where, and what to check (not torch's 30-line store traceback)."""
    from paratrain.env.network import free_port

    res = run_cli(["train", "--max-steps", "1", "--no-progress", "--log-dir", str(tmp_path), "--set",
                   "parallel.timeout_s=3"], timeout=60, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.startswith("paratrain")]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert lines[0].startswith("paratrain train: error: rank 0 of 2 (env) could not form the process group at "
                               "127.0.0.1:"), lines[0]
    assert "1/2 clients joined" in lines[0] and "start all 2 with the same MASTER_ADDR/MASTER_PORT" in lines[0]


# --- bad inputs of issue 14: one line each (in this process: they fail before any worker) -------

def _cifar_dir(root: Path, content: bytes | None = None, crafted: bool = False) -> Path:
    import pickle

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        if crafted:
            class Evil:
                def __reduce__(self):
                    return (os.system, (f"touch {root / 'PWNED'}",))
            content = pickle.dumps({b"data": Evil(), b"labels": [0]})
        (folder / name).write_bytes(content)  # type: ignore[arg-type]
    return root


@pytest.mark.parametrize("case", [
    "malformed yaml", "section as a value", "--set of a whole section", "--set of a subsection",
    "cifar garbage", "cifar truncated", "cifar crafted pickle", "checkpoint dir is a file", "log dir is a file",
    "log dir under a file", "resume with another model", "resume with another optimizer",
])
def test_bad_input_of_issue_14_is_one_line(case: str, tmp_path: Path, finished_mlp_run: Path,
                                           capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    from paratrain.cli.main import main

    monkeypatch.setenv("PARATRAIN_ERROR_DIR", str(tmp_path / "errors"))  # main would set it for the run
    (tmp_path / "afile").write_text("x")
    batch = pickle.dumps({b"data": b"\0" * 3072, b"labels": [0]})
    args, needle = {
        "malformed yaml": (["--config", str(_write(tmp_path / "c.yaml", "model: [cnn\n"))], "is not valid YAML"),
        "section as a value": (["--config", str(_write(tmp_path / "c.toml", "parallel = 5\n"))],
                               "parallel is a section of settings, not a value"),
        "--set of a whole section": (["--set", "parallel=3"], "parallel is a section of settings"),
        "--set of a subsection": (["--set", "parallel.ddp=none"], "parallel.ddp is a section of settings"),
        "cifar garbage": (["--dataset", "cifar10", "--data-dir", str(_cifar_dir(tmp_path / "g", b"\x06garbage"))],
                          "is not a readable CIFAR-10 batch"),
        "cifar truncated": (["--dataset", "cifar10", "--data-dir", str(_cifar_dir(tmp_path / "t", batch[:100]))],
                            "pickle data was truncated"),
        "cifar crafted pickle": (["--dataset", "cifar10", "--data-dir", str(_cifar_dir(tmp_path / "e", crafted=True))],
                                 "refused global"),
        "checkpoint dir is a file": (["--checkpoint-dir", str(tmp_path / "afile"), "--checkpoint-every", "1"],
                                     "--checkpoint-dir"),
        "log dir is a file": (["--log-dir", str(tmp_path / "afile")], "is a file"),
        "log dir under a file": (["--log-dir", str(tmp_path / "afile" / "run")], "is a file"),
        "resume with another model": (["--model", "cnn", "--resume", "--log-dir", str(finished_mlp_run)],
                                      "were written with --model mlp, this run has --model cnn"),
        "resume with another optimizer": (["--optimizer", "adamw", "--resume", "--max-steps", "4", "--log-dir",
                                           str(finished_mlp_run)], "were written with --optimizer sgd"),
    }[case]
    if "--log-dir" not in args:
        args = [*args, "--log-dir", str(tmp_path / "run")]
    assert main(["train", "--no-progress", "--max-steps", "2", *args]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("paratrain train: error:") and needle in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "e" / "PWNED").exists()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_cli_warnings_are_one_line_each() -> None:
    from paratrain.cli.main import _warning_line

    ours = _warning_line("no manifest:\n  cannot check", UserWarning, "/x/paratrain/checkpoint/io.py", 3)
    assert ours == "paratrain: warning: no manifest: cannot check\n"
    theirs = _warning_line("deprecated", FutureWarning, "/venv/torch/jit/_script.py", 9)
    assert theirs == "_script.py:9: FutureWarning: deprecated\n"
