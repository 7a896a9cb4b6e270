import faulthandler
import os
import signal
import sys

# Multi-process tests run several workers on 2 cores: one intra-op thread each keeps them fast.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import cpuaccount  # noqa: E402
import fastlaunch  # noqa: E402
import pace  # noqa: E402

fastlaunch.install()  # multi-process tests fork their workers from a server that has imported torch


import pytest  # noqa: E402

_STDERR_FD = -1  # a copy of stderr made before pytest captures output: where the stacks go


def pytest_configure(config):
    # When scripts/test.sh's outer `timeout` ends the run with SIGTERM, every thread's stack is
    # printed first, to the terminal.
    global _STDERR_FD
    _STDERR_FD = os.dup(sys.stderr.fileno())
    faulthandler.register(signal.SIGTERM, file=_STDERR_FD, all_threads=True, chain=True)
    pace.pace()  # measured once, before pytest-xdist starts its workers (they inherit it)
    cpuaccount.install(config)  # PARATRAIN_TEST_CPU_LOG=FILE: each test's CPU seconds (tests/cpuaccount.py)


def pytest_report_header(config):
    return (f"paratrain: this machine's pace {pace.pace():.2f} (a fresh import of torch against the reference "
            f"{pace.REFERENCE_IMPORT_S} s), times the tests run at once per core: real time limits get that much "
            f"more room (tests/pace.py)")


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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    room = pace.pace() * pace.share()
    if room > 1:  # each test's hard limit (pytest-timeout's, and the stack dump above) with the machine's room
        for item in items:
            marker = item.get_closest_marker("timeout")
            args, kwargs = (list(marker.args), dict(marker.kwargs)) if marker is not None else ([], {})
            limit = args.pop(0) if args else kwargs.pop("timeout", None)
            limit = float(limit if limit is not None else config.getini("timeout"))
            item.add_marker(pytest.mark.timeout(limit * room, *args, **kwargs), append=False)  # method= kept


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where xdist is absent or -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """``-n 3`` (``scripts/test.sh``): xdist's load-scope scheduler over :func:`work_unit` (largest
    units first). pytest-xdist's own ``--dist loadgroup`` cannot be used: it renames a test's
    ``_nodeid``, which pytest 9.2 no longer reads, so its groups are silently ignored.

    Workers beyond the cores (:func:`pace.waiters`) run only the units whose tests are all marked
    ``waits`` (a timeout or a signal waited out, a few core-seconds in many real ones): beside the workers
    that compute, not in their place. The others take those units too once their own are done."""
    if config.getvalue("dist") not in ("load", "loadgroup", "loadscope"):
        return None  # --dist each, loadfile, worksteal: as asked
    from workunits import scheduler

    return scheduler(config, log)


@pytest.fixture(autouse=True)
def _no_record_of_collectives_left_behind():
    """A test that joined a (real or simulated) process group in this process started the record of its
    collectives (``paratrain.trace``): stop it, so that later tests see torch.distributed's own functions."""
    yield
    from paratrain.trace import recorder

    if recorder.active() is not None:
        recorder.stop()
