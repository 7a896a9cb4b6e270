"""Threads inside one process: ``fork``/``wait`` and ``fork_map`` for independent branches, and
``configure_threads`` for how a process's cores are shared between them.

The classic ``torch.jit.fork`` example (``compute(x) = x * x`` twice), written with paratrain::

    fut1 = paratrain.fork(compute, torch.tensor(10))
    fut2 = paratrain.fork(compute, torch.tensor(20))
    result1, result2 = paratrain.wait(fut1), paratrain.wait(fut2)

    outs = paratrain.fork_map(lambda tower: tower(x), [tower_a, tower_b])   # one branch per tower

What overlaps (``benchmarks/threads.py`` measures it; the README has the numbers):

* ``torch.jit.fork`` called from Python runs the function to completion before it returns, also for
  a scripted function (torch's docs: "If run in pure python, fork will not execute in parallel").
  Only a fork *inside* TorchScript runs on the inter-op thread pool. So paratrain forks a
  TorchScript function (``torch.jit.script`` of a function or module, tensor arguments only) through
  a small scripted launcher that contains the ``torch.jit.fork``: the branch then runs on torch's
  inter-op pool without the GIL. Everything else goes to a thread pool of Python threads: ATen
  kernels release the GIL, so compute-heavy branches overlap; the Python between kernels does not.
* Backward: the autograd graph that the branches record is one graph, and on the CPU one
  ``loss.backward()`` runs its nodes one at a time in the calling thread, so backward does not
  overlap (on CUDA the engine has a thread per device). Separate ``backward``/``autograd.grad``
  calls in separate threads do run concurrently on the CPU; ``devices`` with ``micro_batches``
  uses that for its pipelined backward.

Semantics:

* ``fork`` returns a ``torch.futures.Future`` (= ``torch.jit.Future``); a TorchScript branch returns
  what a fork inside TorchScript returns, ``torch._C.Future``, the base class of both. ``wait``
  takes either (and a ``concurrent.futures.Future``); ``fut.wait()`` works too. Not
  ``torch.jit.wait(fut)`` while a TorchScript branch may still run: it keeps the GIL while it
  waits, and such a branch then never finishes (torch 2.13 and 2.14 hang there with torch's own
  scripted forks too); once a branch has finished it returns its result. ``wait`` on a branch that no thread has started yet runs it in the waiting thread, so a
  branch that forks and waits from inside a branch never deadlocks the pool.
* Grad mode, inference mode, autocast (every device type) and the current CUDA device and stream
  are thread-local in torch; ``fork`` captures the caller's and sets them in the branch. Other
  thread-local state (saved-tensor hooks, ``TorchDispatchMode``\\ s, the profiler) is not carried.
* Autograd flows through: the branches record into the caller's graph, and gradients equal the
  sequential computation's (bitwise when at most two branches add into one tensor's gradient; with
  more, the additions may happen in another order, which differs only by rounding).
* An exception raised in a branch is raised by ``wait``, with its type. TorchScript hands a
  scripted branch's exception back as a ``RuntimeError`` whose message ends in
  ``builtins.ValueError: ...``; ``wait`` raises that built-in type again, chained to it.
* ``torch.compile``: ``fork``, ``wait`` and ``fork_map`` are excluded from compilation
  (``torch.compiler.disable``): a compiled function that calls them gets a graph break there, runs
  the branches eagerly and compiles the code around them (``fullgraph=True`` refuses it). To
  compile the branches, compile the branch functions themselves and fork those.

Threads per process: ``torch.set_num_threads`` is the number of intra-op threads, the threads that
one kernel (a matmul, a convolution) splits its work over; ``torch.set_num_interop_threads`` is the
size of the inter-op pool that runs TorchScript forks (paratrain's thread pool has as many
threads). While ``b`` branches run at once, each with ``t`` intra-op threads, ``b × t`` threads
want a core: keep that at or below the process's share of the cores. ``configure_threads`` sets
both from the usable cores and the local world size.
"""

from .branches import BACKENDS, fork, fork_map, wait
from .settings import ThreadSettings, configure_threads, usable_cores

__all__ = ["fork", "wait", "fork_map", "configure_threads", "ThreadSettings", "usable_cores", "BACKENDS"]
