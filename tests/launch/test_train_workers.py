"""``paratrain train --nproc-per-node N``: workers forked from a forkserver that imported torch
(``paratrain.launch.forkserver``), against workers in new interpreters (``--start-method spawn``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from clitools import ROOT, cli_env, killpg, run_cli
from paratrain.launch.forkserver import wants_early_start, worker_environ

pytestmark = pytest.mark.timeout(180)

PLATFORM_START_METHOD = subprocess.run([sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
                                       capture_output=True, text=True, check=True).stdout.strip()
"""What a process that python started uses (fork on Linux before Python 3.14)."""

# A model factory that records, in each worker, what the worker runs with.
PROBE = '''
import json, multiprocessing, os, torch
from paratrain.models.registry import build_model

def make(input_shape, num_classes):
    rank = os.environ["RANK"]
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "threads": torch.get_num_threads(),
                   "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "user": os.environ.get("PROBE_USER"),
                   "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"), "local_rank": os.environ["LOCAL_RANK"],
                   "start_method": multiprocessing.get_start_method()}, f)
    return build_model("mlp", input_shape, num_classes)
'''


@pytest.mark.parametrize("argv, env, expected", [
    (["train", "--strategy", "ddp", "--nproc-per-node", "2"], {}, True),
    (["train", "--nproc_per_node=4"], {}, True),
    (["train", "--nnodes", "2", "--nproc-per-node", "1"], {}, True),
    (["train", "--nproc-per-node", "auto"], {}, True),
    (["train"], {}, False),  # one process: no workers
    (["train", "--nproc-per-node", "1"], {}, False),
    (["run", "--nproc-per-node", "2", "x.py"], {}, False),  # the user's script: a new interpreter each
    (["train", "--nproc-per-node", "2", "--start-method", "spawn"], {}, False),
    (["train", "--nproc-per-node", "2", "--help"], {}, False),
    (["train", "--nproc-per-node", "2"], {"RANK": "0"}, False),  # a worker of torchrun
    (["train", "--nproc-per-node", "2"], {"SLURM_PROCID": "1"}, False),
    (["train", "--nproc-per-node", "2"], {"PARATRAIN_NO_EARLY_FORKSERVER": "1"}, False),
])
def test_early_start_only_for_a_command_that_forks_workers(argv, env, expected):
    assert wants_early_start(argv, env) is expected


def test_worker_environment_is_the_launchers_under_the_agents():
    server = {"PATH": "/bin", "OLD": "server", "GONE": "1"}
    current = {**server, "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"}  # forked, then the agent's variables
    launcher = {"PATH": "/bin", "OLD": "launcher", "NEW": "x", "RANK": "stale"}
    assert worker_environ(launcher, current, server) == {"PATH": "/bin", "OLD": "launcher", "NEW": "x", "RANK": "1",
                                                         "TORCHELASTIC_RESTART_COUNT": "0"}
    # not forked from the server (spawn): the process has the launcher's environment already
    assert worker_environ(launcher, {"OLD": "launcher", "RANK": "1"}, None) == {
        "PATH": "/bin", "OLD": "launcher", "NEW": "x", "RANK": "1"}


def _train(tmp_path: Path, name: str, *extra: str) -> tuple[dict, list[dict], str]:
    probe_dir = tmp_path / f"probe-{name}"
    probe_dir.mkdir()
    (tmp_path / "probe.py").write_text(PROBE)
    env = {k: v for k, v in cli_env(PROBE_DIR=str(probe_dir), PROBE_USER="kept").items()
           if k not in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")}  # both set by the launcher, after the server started
    res = subprocess.run([sys.executable, "-m", "paratrain", "train", "--strategy", "ddp", "--nproc-per-node", "2",
                          "--model", f"{tmp_path / 'probe.py'}:make", "--max-steps", "4", "--no-progress",
                          "--log-dir", str(tmp_path / name), *extra],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=150, start_new_session=True)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / name / "result.json").read_text())
    probes = [json.loads((probe_dir / f"rank{r}.json").read_text()) for r in range(2)]
    return result, probes, (tmp_path / name / "train.csv").read_text()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_workers_train_as_spawned_ones_do(tmp_path):
    forked, fprobes, fcsv = _train(tmp_path, "forked")
    spawned, sprobes, scsv = _train(tmp_path, "spawned", "--start-method", "spawn")
    # forked from one server (not children of the agent, as spawned workers are)
    assert fprobes[0]["ppid"] == fprobes[1]["ppid"] != os.getpid()
    for probe in fprobes + sprobes:
        assert probe["threads"] == 1  # the launcher's OMP_NUM_THREADS (2 cores / 2 workers), not the server's
        assert probe["gloo_ifname"] == "lo" and probe["user"] == "kept" and probe["restart"] == "0"
        # a DataLoader's workers fork, as in a new interpreter (not a forkserver of each rank's own)
        assert probe["start_method"] == PLATFORM_START_METHOD
    assert [p["local_rank"] for p in fprobes] == ["0", "1"]
    # the same training, step for step
    assert forked["world_size"] == spawned["world_size"] == 2
    assert forked["train_loss"] == pytest.approx(spawned["train_loss"], rel=1e-6)
    assert [ln.split(",")[1] for ln in fcsv.splitlines()] == [ln.split(",")[1] for ln in scsv.splitlines()]


def test_a_failing_forked_worker_is_one_line(tmp_path):
    res = run_cli(["train", "--strategy", "ddp", "--nproc-per-node", "2", "--max-steps", "20", "--no-progress",
                   "--log-dir", str(tmp_path)], timeout=120, PARATRAIN_TEST_KILL_AT="1:3")
    assert res.returncode == 137, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("paratrain: ")]
    assert len(lines) == 1 and "rank 1" in lines[0] and "SIGKILL" in lines[0], res.stderr[-3000:]


def _forkservers_with(marker: str) -> list[int]:
    """Python forkservers (not their resource tracker) whose environment holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f, open(f"/proc/{entry}/cmdline", "rb") as c:
                    if marker.encode() in f.read() and b"multiprocessing.forkserver" in c.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (Linux)")
def test_a_command_that_fails_at_once_leaves_no_forkserver_behind():
    """The server started first thing is stopped when the command exits, not seconds later."""
    import uuid

    marker = f"forkserver-{uuid.uuid4().hex}"
    with tempfile.TemporaryFile("w+") as err:  # not a pipe: nothing waits for the server to close it
        proc = subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--strategy", "ddp", "--nproc-per-node",
                                 "2", "--backend", "pigeon", "--log-dir", "none"], cwd=ROOT,
                                env=cli_env(PROBE_MARK=marker), stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
        try:
            assert proc.wait(timeout=60) == 2
            left = _forkservers_with(f"PROBE_MARK={marker}")  # at once: the server imports torch for seconds
        finally:
            killpg(proc)
        err.seek(0)
        assert "backend 'pigeon' is unknown" in err.read()
    assert left == []
