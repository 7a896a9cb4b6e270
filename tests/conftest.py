import os
import sys

# Multi-process tests run several workers on 2 cores: one intra-op thread each keeps them fast.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
