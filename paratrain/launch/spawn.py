"""``paratrain.launch``: run a function on N local processes (like ``torch.multiprocessing.spawn``).

Built on :func:`torch.multiprocessing.start_processes`. Each process gets the same environment
variables that ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), so code inside ``fn`` calls :func:`paratrain.init` exactly as under ``torchrun``.
"""

from __future__ import annotations

import atexit
import os
import pickle
import tempfile
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from ..env.network import free_port  # re-exported: the launch API's port picker
from ..env.process import AGENT_PID
from ..trace.recorder import TRACE_DIR
from .notebook import check_fork_safe, needs_fork
from .forkserver import TRAINING_IMPORTS, platform_start_method

__all__ = ["launch", "free_port", "LaunchError"]


class LaunchError(RuntimeError):
    """A launched worker failed, the launch ran past its time limit, or its workers cannot start."""


# A launcher's variables that a worker of paratrain.launch must not inherit from its caller (a
# torchrun worker itself): its rendezvous is its own, not the caller's agent's store.
_INHERITED = ("TORCHELASTIC_", "ROLE_", "GROUP_WORLD_SIZE")


def _worker(local_rank: int, fn: Callable, nprocs: int, env: dict[str, str], args: tuple, out_dir: str,
            forked: bool = False) -> None:
    if not forked:
        platform_start_method()
    else:
        # A forked worker ends with os._exit: the parent's (a kernel's) exit handlers must never run
        # here, and its own (leaving the process group, see env.process) run below, as at a
        # spawned worker's exit.
        atexit._clear()
        # One intra-op thread unless the caller's env says otherwise: a forked process cannot use
        # the OpenMP threads its parent started, and its first parallel op with more would hang
        # once the notebook has run one (torch's CPU build, GNU OpenMP).
        threads = env.get("OMP_NUM_THREADS", "").strip()
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)
    try:
        _run(local_rank, fn, env, args, out_dir)
    finally:
        if forked:
            atexit._run_exitfuncs()


def _run(local_rank: int, fn: Callable, env: dict[str, str], args: tuple, out_dir: str) -> None:
    for name in [n for n in os.environ if n.startswith(_INHERITED)]:
        del os.environ[name]
    os.environ.update(env)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), GROUP_RANK="0", PARATRAIN_SPAWNED="1")
    try:
        result = fn(local_rank, *args)
    except BaseException as e:
        from ..env.failures import explain_failure
        from ..env.uncaught import mark_failed

        mark_failed()  # at exit: no barrier with peers that may never come
        why = explain_failure(e)  # a failed collective: who did not arrive, or which peer ended first
        if why is not None:
            raise why from e
        raise
    # Results travel through files in a private directory the parent created for this launch.
    # Written whole or not at all: the parent takes a rank's file as proof that it returned.
    path = os.path.join(out_dir, f"{local_rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".part", path)


def exception_line(text: str) -> str:
    """The line of a formatted traceback that says what was raised (``ValueError: ...``), not its
    last line (a multi-line message can end in ``)``); the last meaningful line if there is none."""
    lines = text.strip().splitlines()
    start = max((i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")), default=-1)
    if start >= 0:
        for ln in lines[start + 1:]:
            if ln.strip() and not ln[0].isspace():
                return ln.strip()
    meaningful = [ln.strip() for ln in lines if ln.strip().strip("()[]{},.;:")]
    return meaningful[-1] if meaningful else text.strip()


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout: float | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: dict[str, str] | None = None,
    start_method: str = "spawn",
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(local_rank, *args)`` in ``nprocs`` fresh processes and return their results.

    Args:
        fn: a picklable (module-level) function. It receives the process index first, like
            :func:`torch.multiprocessing.spawn`. In Jupyter/IPython (any session whose
            ``__main__`` a new interpreter cannot import) a function defined there, or ``args``
            that refer to it, run in workers *forked* from this process whatever
            ``start_method`` says: on the CPU, or while CUDA is not initialised here (else a
            one-line :class:`LaunchError`: restart the kernel and launch before touching CUDA).
            Forked workers run one intra-op thread each (``torch.set_num_threads``) unless
            ``env`` sets ``OMP_NUM_THREADS``: more hang in a process forked after the notebook
            ran a parallel op.
        nprocs: number of processes (the world size; one node).
        args: extra positional arguments for ``fn``.
        timeout: hard wall-clock limit in seconds; past it every worker is killed and
            :class:`LaunchError` is raised. ``None`` waits forever.
        master_addr: rendezvous address; loopback by default so nothing listens on other interfaces.
        master_port: rendezvous port; a free one is picked when ``None``.
        env: extra environment variables for the workers.
        start_method: ``spawn`` (a new interpreter per worker) or ``forkserver``: the workers fork
            from a server process, started once per parent, that has imported the modules named in
            ``preload`` (e.g. ``torch``); every launch still gets new processes, without paying
            python's and those modules' start-up again (seconds per process for torch). The server
            keeps the environment it started with: ``env`` is set in each worker before ``fn``
            runs, after the preloaded modules read theirs (set thread counts in ``fn``).
        preload: modules the forkserver imports (taken when the server starts: the first
            ``forkserver`` launch of this process). Where it names any, the server also imports
            what torch imports lazily in every worker that trains
            (:data:`paratrain.launch.forkserver.TRAINING_IMPORTS`: the first optimizer's
            ``torch._dynamo``), once, instead of each worker.

    Returns:
        ``fn``'s return value from each rank, in rank order.

    Raises:
        LaunchError: naming the first rank that failed (and its exception), or the ranks still
            running when ``timeout`` expired; or, before any worker starts, that a notebook's
            function cannot be forked because CUDA is initialised in this process.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs} must be at least 1")
    worker_env = {
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port or free_port(master_addr)),
        AGENT_PID: str(os.getpid()),  # the workers end with this process
        **(env or {}),
    }
    trace_dir = worker_env.get(TRACE_DIR)
    if master_addr in ("127.0.0.1", "localhost"):
        worker_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method {start_method!r} is unknown: use spawn or forkserver")
    forked = needs_fork(fn, tuple(args))  # a notebook's function: a new interpreter cannot import it
    if forked:
        check_fork_safe(fn, LaunchError)
        start_method = "fork"
    elif start_method == "forkserver" and preload:
        # what any training worker imports too (the first optimizer's torch._dynamo): once in the server
        mp.get_context("forkserver").set_forkserver_preload(list(dict.fromkeys((*preload, *TRAINING_IMPORTS))))
    deadline = None if timeout is None else time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="paratrain-launch-") as out_dir:
        if trace_dir is None:  # each rank's record of its collectives (paratrain.trace), read if one fails
            worker_env[TRACE_DIR] = os.path.join(out_dir, "trace")
        ctx = mp.start_processes(
            _worker,
            args=(fn, nprocs, worker_env, tuple(args), out_dir, forked),
            nprocs=nprocs,
            join=False,
            start_method=start_method,
        )
        try:
            while not ctx.join(timeout=0.2, grace_period=5):
                if deadline is not None and time.monotonic() > deadline:
                    alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                    said = _records_say(worker_env[TRACE_DIR], None, "")
                    raise LaunchError(
                        f"launch timed out after {timeout:.0f}s with ranks {alive} still running"
                        + (f": {said[0]}" if said else " (a collective that never completes?)")
                        + "; all workers were killed")
        except ProcessRaisedException as e:
            line = exception_line(str(e))
            if line.partition(": ")[0].rpartition(".")[2] in _SAID:  # the records were compared already
                raise LaunchError(f"rank {e.error_index} failed: {line}") from e
            said = _records_say(worker_env[TRACE_DIR], e.error_index, line)
            if said is not None and said[1]:  # the ranks went different ways: the cause, whoever raised first
                raise LaunchError(f"{said[0]} (rank {e.error_index}: {line.partition(': ')[2]})") from e
            raise LaunchError(f"rank {e.error_index} failed: {line}" + (f"; {said[0]}" if said else "")) from e
        except ProcessExitedException as e:
            done = _results(out_dir, nprocs)
            if e.exit_code < 0 and done is not None:
                # Every rank returned and wrote its result; the signal came as a process was ending
                # (a library's threads aborting in teardown, e.g. gloo's): the work is done and kept.
                warnings.warn(f"paratrain.launch: rank {e.error_index} was ended by {e.signal_name} after "
                              "it returned its result; every rank's result is kept", RuntimeWarning, stacklevel=2)
                return done
            how = f"exited with code {e.exit_code}" + (f" ({e.signal_name})" if e.exit_code < 0 else "")
            said = _records_say(worker_env[TRACE_DIR], e.error_index, "")
            if said is not None and said[1]:
                raise LaunchError(f"{said[0]} (rank {e.error_index} {how})") from e
            raise LaunchError(f"rank {e.error_index} {how}" + (f"; {said[0]}" if said else "")) from e
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        done = _results(out_dir, nprocs)
        if done is None:  # every process exited 0 without a result: only a worker's own os._exit(0) does that
            raise LaunchError("a rank exited with code 0 before returning from the launched function")
        return done


_SAID = ("CollectiveTimeoutError", "CollectiveMismatchError")  # errors whose line compared the ranks' records


def _records_say(trace_dir: str, failed: int | None, message: str) -> tuple[str, bool] | None:
    """What the ranks' records of their collectives add to a failure (:func:`paratrain.trace.analyze.cause`)."""
    from ..trace.analyze import cause
    from ..trace.recorder import read_dir

    try:
        return cause(read_dir(trace_dir), failed, message)
    except Exception:  # noqa: BLE001 - a record the analysis cannot read must not hide the failure itself
        return None


def _results(out_dir: str, nprocs: int) -> list[Any] | None:
    """Every rank's result in rank order; None unless all of them wrote one."""
    paths = [os.path.join(out_dir, f"{rank}.pkl") for rank in range(nprocs)]
    if not all(os.path.exists(p) for p in paths):
        return None
    results = []
    for path in paths:
        with open(path, "rb") as f:
            results.append(pickle.load(f))
    return results
