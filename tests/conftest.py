import faulthandler
import os
import signal
import sys

# Multi-process tests run several workers on 2 cores: one intra-op thread each keeps them fast.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import fastlaunch  # noqa: E402

fastlaunch.install()  # multi-process tests fork their workers from a server that has imported torch


def pytest_configure(config):
    # A test blocked inside C (a native wait, a lock) never sees pytest-timeout's SIGALRM; pytest's
    # faulthandler_timeout prints its stack. When scripts/test.sh's outer `timeout` then ends the
    # run with SIGTERM, every thread's stack is printed first, to the terminal (as pytest's own
    # faulthandler does, on a copy of stderr made before output is captured).
    faulthandler.register(signal.SIGTERM, file=os.dup(sys.stderr.fileno()), all_threads=True, chain=True)
