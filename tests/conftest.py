import os
import sys

# Multi-process tests run several workers on 2 cores: one intra-op thread each keeps them fast.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import fastlaunch  # noqa: E402

fastlaunch.install()  # multi-process tests fork their workers from a server that has imported torch
