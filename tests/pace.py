"""This machine's pace: how much slower than the reference machine it starts Python and torch.

The suite's real time limits (a CLI run's hard limit, a selftest's budget, "ends within N s")
were set on a quiet 2-core machine. A slower or busier one of the same kind (``import torch``
taking 3.7 s instead of 1.3 s) would fail them without anything being wrong. So the session
measures, once before the first test, what every multi-process test pays most: starting a fresh
interpreter that imports torch; :data:`PACE` is that time over the reference machine's, never
below 1. :func:`scaled` gives a limit room in proportion. The measurement is handed to pytest-xdist's
workers and to every child process through ``PARATRAIN_TEST_PACE`` (set it to skip the measurement).

The suite also runs more tests at once than the machine has cores (``scripts/test.sh``: three
pytest-xdist workers on two cores; the third runs only the tests that mostly wait on a signal or a
timeout, :func:`waiters`). Such a test gets ``cores / workers`` of the machine while the others
compute: :func:`share` is that oversubscription (never below 1), and :func:`scaled` gives it room too.

A limit that states what the product promises (e.g. "the job ends within timeout_s + 15 s") keeps
its product term and scales only the allowance for the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

ENV = "PARATRAIN_TEST_PACE"
REFERENCE_IMPORT_S = 1.5
"""``python -c 'import torch'`` (the CPU build, bytecode compiled) on the reference 2-core machine, quiet."""
MAX_PACE = 4.0


def measure() -> float:
    """The fastest of three fresh ``import torch`` over the reference, clamped to [1, MAX_PACE]."""
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True, timeout=120)
        took.append(time.monotonic() - t0)
    return min(MAX_PACE, max(1.0, min(took) / REFERENCE_IMPORT_S))


def pace() -> float:
    """``PARATRAIN_TEST_PACE``, measured (and set) by the first caller when absent."""
    if ENV not in os.environ:
        os.environ[ENV] = f"{measure():.2f}"
    return float(os.environ[ENV])


def cores() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def waiters(workers: int) -> set[str]:
    """The pytest-xdist workers (their ids) beyond the cores, of ``workers`` in all: they run only tests marked
    ``waits`` (``tests/conftest.py``'s scheduler), beside one worker per core that computes."""
    return {f"gw{i}" for i in range(cores(), workers)}


def share() -> float:
    """How many tests run at once per core, as this test sees it, never below 1. A worker that computes shares
    its core with none (the workers beyond the cores mostly wait); one of those beyond them (:func:`waiters`)
    shares the machine with every worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if os.environ.get("PYTEST_XDIST_WORKER", "") not in waiters(workers):
        workers = min(workers, cores())
    return max(1.0, workers / max(1, cores()))


def scaled(seconds: float) -> float:
    """``seconds`` of a real limit set on the reference machine, with this machine's room: its pace,
    and the share of it each test gets when the suite runs more tests at once than it has cores."""
    return seconds * pace() * share()


if __name__ == "__main__":  # `python tests/pace.py [SECONDS]`: the pace (PARATRAIN_TEST_PACE, else measured now), or
    # SECONDS with its room
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seconds", type=float, nargs="?", help="a limit set on the reference machine")
    args = ap.parse_args()
    print(f"{pace():.2f}" if args.seconds is None else f"{args.seconds * pace():.0f}")
