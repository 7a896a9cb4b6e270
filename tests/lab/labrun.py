"""Start commands on lab hosts, each in its own process group with a hard time limit."""

from __future__ import annotations

import subprocess
import sys
import time

from clitools import cli_env, killpg


def start(lab, host: int, args: list[str], **env: str) -> subprocess.Popen:
    """``python -m paratrain ARGS`` on lab host ``host``, in a new process group."""
    return subprocess.Popen(lab.exec_argv(host, [sys.executable, "-m", "paratrain", *args]), env=cli_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


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
