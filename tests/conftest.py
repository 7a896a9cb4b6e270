import faulthandler
import os
import re
import signal
import sys
from pathlib import Path

# Multi-process tests run several workers on 2 cores: one intra-op thread each keeps them fast.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import fastlaunch  # noqa: E402
import pace  # noqa: E402

fastlaunch.install()  # multi-process tests fork their workers from a server that has imported torch


import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_STDERR_FD = -1  # a copy of stderr made before pytest captures output: where the stacks go


def pytest_configure(config):
    # When scripts/test.sh's outer `timeout` ends the run with SIGTERM, every thread's stack is
    # printed first, to the terminal.
    global _STDERR_FD
    _STDERR_FD = os.dup(sys.stderr.fileno())
    faulthandler.register(signal.SIGTERM, file=_STDERR_FD, all_threads=True, chain=True)
    pace.pace()  # measured once, before pytest-xdist starts its workers (they inherit it)


def pytest_report_header(config):
    return (f"paratrain: this machine's pace {pace.pace():.2f} (a fresh import of torch against the reference "
            f"{pace.REFERENCE_IMPORT_S} s): real time limits get that much more room (tests/pace.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # A test blocked inside C (a native wait, a lock held by another thread) never sees
    # pytest-timeout's SIGALRM. 30 s after its timeout every thread's stack is printed and the run
    # ends with exit status 1: a failure within minutes, not a CI stuck until the outer limit.
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker is not None and marker.args else float(item.config.getini("timeout"))
    faulthandler.dump_traceback_later(limit + 30, exit=True, file=_STDERR_FD)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


_ONE_WORKER = {"lab": "tests/lab/", "package": "tests/test_package.py"}
"""Tests that share a machine-wide resource run in one pytest-xdist worker, one after another: the
lab's network namespaces, Slurm and MPI daemons (session fixtures that two workers would both bring
up); the package's builds, which write build/ and paratrain.egg-info/ in the checkout."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    room = pace.pace()
    if room > 1:  # each test's hard limit (pytest-timeout's, and the stack dump above) with the machine's room
        for item in items:
            marker = item.get_closest_marker("timeout")
            limit = float(marker.args[0]) if marker is not None and marker.args else float(config.getini("timeout"))
            item.add_marker(pytest.mark.timeout(limit * room), append=False)


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs as a whole: a group of :data:`_ONE_WORKER`, a module with a
    module-scoped fixture (a trained reference run, a built wheel: split across two workers, each
    would build it), or else the test alone."""
    path = nodeid.replace("\\", "/").split("::")[0]
    group = next((g for g, prefix in _ONE_WORKER.items() if path.startswith(prefix)), None)
    if group is not None:
        return group
    return path if _has_module_fixture(path) else nodeid


_MODULE_FIXTURE = re.compile(r"""@pytest\.fixture\(.*scope=["'](module|session)["']""")
_module_fixtures: dict[str, bool] = {}


def _has_module_fixture(path: str) -> bool:
    if path not in _module_fixtures:
        try:
            text = (ROOT / path).read_text()
        except OSError:
            text = ""
        _module_fixtures[path] = bool(_MODULE_FIXTURE.search(text))
    return _module_fixtures[path]


def pytest_xdist_make_scheduler(config, log):
    """``-n 2`` (``scripts/test.sh``): xdist's load-scope scheduler over :func:`work_unit` (largest
    units first). pytest-xdist's own ``--dist loadgroup`` cannot be used: it renames a test's
    ``_nodeid``, which pytest 9.2 no longer reads, so its groups are silently ignored."""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") not in ("load", "loadgroup", "loadscope"):
        return None  # --dist each, loadfile, worksteal: as asked

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)
