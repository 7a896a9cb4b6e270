"""Where the suite's CPU goes: with ``PARATRAIN_TEST_CPU_LOG=FILE``, each test's CPU seconds (setup, call and
teardown), its own and those of every process it started, are appended to FILE as
``<wall s> <cpu s> <worker> <test id>``; sort by the second column to see what costs the cores.

A test's wall time says little on 2 busy cores (a test waits while the other worker's test computes), and a
process tree's own accounting misses the workers that fork from a server (``tests/fastlaunch.py``,
``tests/zygote.py``, ``multiprocessing``'s forkserver). So each pytest process (each pytest-xdist worker) moves
itself into a cgroup (v2) of its own before it starts anything, and every process it starts inherits it; the
cgroup's ``cpu.stat`` counts them all. Needs root and a cgroup v2 hierarchy; elsewhere nothing is written and a
warning says why."""

from __future__ import annotations

import os
import time
import warnings

import pytest

ENV = "PARATRAIN_TEST_CPU_LOG"
_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")  # cgroup v2: hybrid layouts mount it at unified/


def _own_cgroup() -> str | None:
    name = f"paratrain-test-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}"
    for root in _ROOTS:
        if not os.path.exists(os.path.join(root, "cgroup.procs")) or not os.path.exists(os.path.join(root, "cpu.stat")):
            continue
        path = os.path.join(root, name)
        for old in os.listdir(root):  # an earlier run's, empty now (a cgroup with processes in it stays)
            if old.startswith("paratrain-test-"):
                try:
                    os.rmdir(os.path.join(root, old))
                except OSError:
                    pass
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            return path
        except OSError as e:
            warnings.warn(f"{ENV}: cannot make the cgroup {path} ({e}): no CPU accounting", stacklevel=1)
            return None
    warnings.warn(f"{ENV}: no cgroup v2 hierarchy under {' or '.join(_ROOTS)}: no CPU accounting", stacklevel=1)
    return None


class CpuAccount:
    def __init__(self, log: str) -> None:
        self.log = log
        self.cgroup = _own_cgroup()

    def used(self) -> float:
        assert self.cgroup is not None
        with open(os.path.join(self.cgroup, "cpu.stat")) as f:
            return int(f.readline().split()[1]) / 1e6  # usage_usec

    def pytest_unconfigure(self, config):
        """Back to the parent cgroup, and this one removed once nothing runs in it (else it stays: harmless)."""
        if self.cgroup is None:
            return
        try:
            with open(os.path.join(os.path.dirname(self.cgroup), "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            os.rmdir(self.cgroup)
        except OSError:
            pass

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.cgroup is None:
            yield
            return
        cpu, wall = self.used(), time.monotonic()
        yield
        with open(self.log, "a") as f:
            f.write(f"{time.monotonic() - wall:8.1f} {self.used() - cpu:8.1f} "
                    f"{os.environ.get('PYTEST_XDIST_WORKER', '-')} {item.nodeid}\n")


def install(config: pytest.Config) -> None:
    """Register the accounting when ``PARATRAIN_TEST_CPU_LOG`` names a file (in the controller and in each worker;
    only the processes that run tests write)."""
    log = os.environ.get(ENV)
    if log:
        config.pluginmanager.register(CpuAccount(log), "paratrain-cpu-account")
