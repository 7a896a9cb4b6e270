"""Reliability: what happens to a run when things go wrong around it (real processes, hard limits)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from clitools import killpg, run_cli, start_cli

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


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (Linux)")
def test_workers_stop_when_their_agent_is_killed(tmp_path: Path) -> None:
    """SIGKILL the torchrun agent (as an OOM kill would): its workers must not train on."""
    proc = start_cli(["train", "--strategy", "ddp", "--nproc-per-node", "2", "--epochs", "1000", "--no-progress",
                      "--log-dir", str(tmp_path), "--checkpoint-every", "5"])
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while time.monotonic() < deadline and not (tmp_path / "checkpoints").exists():
            time.sleep(0.2)  # training has started once the first checkpoint is there
        workers = _children(proc.pid)
        assert len(workers) == 2, f"expected 2 workers under the agent, found {workers}"
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
