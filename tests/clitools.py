"""Run the ``paratrain`` CLI in a fresh process group with a hard time limit.

Past the limit the whole group (torchrun agent and its workers) is SIGKILLed and the test fails,
so a deadlocked collective cannot hang the suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zygote
from pace import scaled

ROOT = Path(__file__).resolve().parents[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a paratrain process of a test; a ``PARATRAIN_TEST_*`` fault in ``extra``
    puts ``tests/faults`` (its ``sitecustomize`` injects the fault) on ``PYTHONPATH``."""
    env = dict(os.environ)
    env.update(extra)
    faults = str(ROOT / "tests" / "faults") if any(k.startswith("PARATRAIN_TEST_") for k in extra) else None
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), faults, os.environ.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_cli(args: list[str], cwd: Path = ROOT, fresh: bool = False, **env: str) -> subprocess.Popen:
    """Start ``python -m paratrain ARGS`` in ``cwd`` (default: the repo root) in a new process group.
    It forks from the session's zygote (tests/zygote.py: torch imported once); ``fresh``: a new
    interpreter."""
    popen = zygote.ZygotePopen if not fresh and zygote.enabled() else subprocess.Popen
    return popen(
        [sys.executable, "-m", "paratrain", *args],
        cwd=cwd, env=cli_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )


def killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for ``proc``; past ``timeout`` seconds (with this machine's room, tests/pace.py) SIGKILL its
    whole process group and fail."""
    timeout = scaled(timeout)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        killpg(proc)
        out, err = proc.communicate()
        pytest.fail(f"paratrain {proc.args[3:]} ran past {timeout}s and was killed\n{err[-4000:]}")
    finally:
        killpg(proc)  # workers left behind by a failed agent
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(args: list[str], timeout: float = 60, cwd: Path = ROOT, fresh: bool = False,
            **env: str) -> subprocess.CompletedProcess:
    return finish(start_cli(args, cwd, fresh, **env), timeout)
