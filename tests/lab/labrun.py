"""Start commands on lab hosts, each in its own process group with a hard time limit."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pathlib import Path

import pytest
import zygote

from clitools import cli_env, killpg


def start(lab, host: int, args: list[str], **env: str) -> subprocess.Popen:
    """``python -m paratrain ARGS`` on lab host ``host``, in a new process group."""
    environ = cli_env(**env)
    return subprocess.Popen(lab.exec_argv(host, paratrain(environ, args)), env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def paratrain(env: dict[str, str], args: list[str]) -> list[str]:
    """The command line of ``python -m paratrain ARGS`` on a lab host (or a launcher's task): the zygote's shim
    (tests/zygote.py: the command forks from the session's server, torch imported once, into the host's network,
    hostname and mount namespaces), given ``env`` names the server; a new interpreter while
    ``PARATRAIN_TEST_ZYGOTE=0``."""
    if not zygote.enabled():
        return [sys.executable, "-m", "paratrain", *args]
    env["PARATRAIN_ZYGOTE"] = zygote.start_server(env)
    return [zygote.shim(), *args]


def paratrain_on_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` whose ``PATH`` finds ``paratrain`` (a Slurm job script's): the zygote's shim as in :func:`paratrain`,
    else the venv's own command."""
    folders = [os.path.dirname(sys.executable)]
    if zygote.enabled():
        folders.insert(0, os.path.dirname(paratrain(env, [])[0]))
    env["PATH"] = os.pathsep.join([*folders, env.get("PATH", "")])
    return env


def finish_all(procs: list[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
    """Wait for every process; past ``timeout`` seconds in all, kill every group and fail."""
    deadline = time.monotonic() + timeout
    done = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    killpg(q)
                raise AssertionError(f"{p.args} ran past {timeout}s and was killed") from None
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            killpg(p)
    return done


# The built-in job (mlp on digits), ddp, 40 steps (0.2 s of compute: launching is what costs),
# checkpointed every 10 (the elastic test resumes from one).
STEPS = 40
TRAIN_ARGS = ["--strategy", "ddp", "--max-steps", str(STEPS), "--epochs", "100", "--checkpoint-every", "10",
              "--no-progress"]


def final_state(log_dir: Path, checkpoints: Path | None = None) -> tuple[dict, dict]:
    """The model state of a train run's last checkpoint, and its result.json."""
    import json

    import torch

    ckpt = (checkpoints or log_dir / "checkpoints") / f"step-{STEPS:08d}.pt"
    return torch.load(ckpt, weights_only=True)["model"], json.loads((log_dir / "result.json").read_text())


def assert_same_run(got_dir: Path, want_dir: Path, world_size: int = 2, checkpoints: Path | None = None) -> float:
    """The same final weights (rel 1e-5; rounding gaps measured ~1e-7) and, at the same world size,
    the same final train loss; returns the largest relative error."""
    from parity import assert_same_state

    got, got_result = final_state(got_dir, checkpoints)
    want, want_result = final_state(want_dir)
    assert got_result["world_size"] == world_size and want_result["world_size"] == 2
    if world_size == 2:
        assert got_result["train_loss"] == pytest.approx(want_result["train_loss"], rel=1e-5)
    return assert_same_state(got, want, 1e-5)
