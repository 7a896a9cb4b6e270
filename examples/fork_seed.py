"""The seed's multi-threading example (``torch.jit.fork``/``wait``), then with paratrain.

The seed forks ``compute`` twice from Python. torch runs a ``torch.jit.fork`` called from Python
before it returns ("If run in pure python, fork will not execute in parallel"), so the seed's two
calls run one after the other. ``paratrain.fork`` runs them concurrently: a TorchScript function
through a fork inside TorchScript (torch's inter-op pool), any other function on a thread pool.

    python examples/fork_seed.py
"""

import threading
import time
import warnings

import torch
from torch import jit

import paratrain

warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates torch.jit.fork/wait/script


# --- the seed, unchanged -------------------------------------------------------------------------
# 定义一个计算密集型函数 (a compute-heavy function)
def compute(x):
    return x * x


# 使用 fork 并行执行多个计算 (run several computations in parallel with fork)
fut1 = jit.fork(compute, torch.tensor(10))
fut2 = jit.fork(compute, torch.tensor(20))

# 等待并获取结果 (wait and collect the results)
result1 = jit.wait(fut1)
result2 = jit.wait(fut2)

print("seed:      ", result1, result2)

# --- the same with paratrain -----------------------------------------------------------------------
fut1 = paratrain.fork(compute, torch.tensor(10))
fut2 = paratrain.fork(compute, torch.tensor(20))
result1, result2 = paratrain.wait(fut1), paratrain.wait(fut2)
print("paratrain: ", result1, result2)

# --- where each ran ----------------------------------------------------------------------------------
main = threading.get_ident()
print("torch.jit.fork from Python ran in the caller:", jit.wait(jit.fork(threading.get_ident)) == main)
fut = paratrain.fork(threading.get_ident)
time.sleep(0.05)  # the caller's own work; a branch that no thread has started when wait() comes runs in the caller
print("paratrain.fork ran in another thread:       ", paratrain.wait(fut) != main)

# --- a heavier compute, where running at once pays: one intra-op thread per branch ------------------
torch.set_num_threads(1)
a, b = torch.randn(1024, 1024) / 32, torch.randn(1024, 1024) / 32


def heavy(x):
    return compute(x @ x)


def timed(fn, reps=5):
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


t_seq = timed(lambda: (heavy(a), heavy(b)))
t_jit = timed(lambda: (jit.wait(jit.fork(heavy, a)), jit.wait(jit.fork(heavy, b))))
t_pt = timed(lambda: paratrain.fork_map(heavy, [a, b]))
print(f"x @ x then x * x on two 1024x1024 matrices: sequential {t_seq:.1f} ms, eager jit.fork {t_jit:.1f} ms, "
      f"paratrain.fork_map {t_pt:.1f} ms (2 cores: up to 2x; benchmarks/threads.py measures it properly)")
