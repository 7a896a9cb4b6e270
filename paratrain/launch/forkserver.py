"""``paratrain.launch.forkserver``: ``paratrain train``'s workers fork from a server that has imported torch.

A worker that torchrun starts as a new interpreter (``python -m paratrain train ...``) pays python's
start and the import of torch and paratrain again: seconds per worker, on every worker at once. A
hand-written ``torchrun`` script pays the same. ``paratrain train --nproc-per-node N`` instead hands
torchrun's elastic agent a *function* (:func:`train_worker`) with ``start_method="forkserver"``
(torch's own ``torch.distributed.launcher.api.elastic_launch`` and ``start_processes``): the workers
fork from Python's forkserver, which imported torch and paratrain once (``multiprocessing``'s
``set_forkserver_preload``), and which :func:`start_early` starts at the very beginning of the
command, so it imports them while the command itself does (two cores, two imports at once).

Nothing else changes: the agent, its rendezvous, restarts and failure reports are torchrun's; the
forkserver holds no CUDA state (it only imports), so a forked worker may use CUDA. ``--start-method
spawn`` gives every worker a fresh interpreter again. The early start is skipped under another
launcher (a worker of torchrun, Slurm or MPI) and with ``PARATRAIN_NO_EARLY_FORKSERVER=1``; the
server then starts when the workers do.

This module uses only the standard library at import: :func:`start_early` runs before torch is
imported.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
from typing import Mapping, Sequence

__all__ = ["PRELOAD", "TRAINING_IMPORTS", "start_early", "wants_early_start", "ensure_running", "train_worker", "apply_omp_threads", "worker_environ"]

TRAINING_IMPORTS = ("torch._dynamo",)
"""What torch imports lazily in every process that trains, which a forkserver imports for its workers: the first
optimizer (``torch.optim.Optimizer.__init__``) imports ``torch._dynamo``, 2-3 s of CPU in each worker that
imports it itself (1.8 s of a 1.9 s ``paratrain verify`` worker on a 2-core machine)."""

# What the server imports: this module (which records the server's environment) and the modules a
# default `paratrain train` job runs, so that the workers import nothing heavy themselves.
PRELOAD = ["paratrain.launch.forkserver", "paratrain.cli.main", "paratrain.cli.train", "paratrain.loop.train",
           *TRAINING_IMPORTS]

# Variables that make this process a worker of another launcher: no workers of its own to start.
_LAUNCHER_WORKER = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")

# The environment this process had when it was imported. In the forkserver (which imports this
# module first) that is the environment every forked worker starts from; see train_worker.
_SERVER_ENV = dict(os.environ)
_IMPORTED_IN = os.getpid()


def _flag(argv: Sequence[str], *names: str) -> str | None:
    """The value of the last ``--name V`` or ``--name=V`` in ``argv``, else None."""
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def wants_early_start(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether ``paratrain ARGV`` will start workers of its own through the forkserver: ``train``
    with more than one worker on this node or several nodes, not under another launcher."""
    if not argv or argv[0] != "train" or environ.get("PARATRAIN_NO_EARLY_FORKSERVER") == "1":
        return False
    if any(key in environ for key in _LAUNCHER_WORKER):
        return False
    if any(arg in ("-h", "--help", "--print-config") for arg in argv):
        return False
    if _flag(argv, "--start-method", "--start_method") not in (None, "forkserver"):
        return False
    nproc = _flag(argv, "--nproc-per-node", "--nproc_per_node")
    nnodes = _flag(argv, "--nnodes")
    return nproc not in (None, "1") or nnodes not in (None, "1")


_STOP_REGISTERED = False  # _stop_server is registered to run at exit
# Signals the server ignores: Slurm signals every process of a job step (SIGTERM, its --signal's
# USR1/USR2), and a server that died of one would make the agent see every worker as ended (exit
# 255) while they still save their checkpoint (paratrain.env.preemption). Its workers take them back.
SERVER_IGNORES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def ensure_running() -> None:
    """Start the forkserver with :data:`PRELOAD` unless it runs already (it then keeps what it
    imported). It imports in the background: this returns at once. When this process exits,
    the server it started is stopped (see :func:`_stop_server`)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in SERVER_IGNORES} if main else {}
    try:  # the server inherits SIG_IGN through its exec; this process keeps its own handlers
        multiprocessing.forkserver.ensure_running()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    global _STOP_REGISTERED
    if not _STOP_REGISTERED:
        atexit.register(_stop_server)
        _STOP_REGISTERED = True


def _stop_server() -> None:
    """End the forkserver that this process started (SIGKILL: it ignores SIGTERM). It would end by
    itself once this process and every worker are gone, but only after it finished importing torch:
    a command that failed at once (a bad value) would keep its output pipes open for seconds. By
    the time the command exits, torchrun's agent has ended its workers."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def start_early() -> None:
    """Called first thing when ``paratrain`` is imported: when this process is the ``paratrain``
    command and will fork workers (:func:`wants_early_start`), start the forkserver now, so that
    it imports torch while this process does."""
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    if program not in ("paratrain", "-m"):  # the console script, or python -m paratrain
        return
    if wants_early_start(sys.argv[1:], os.environ) and "forkserver" in multiprocessing.get_all_start_methods():
        try:
            ensure_running()
        except OSError:  # no fork server here (a platform without AF_UNIX): started later, or spawn is used
            pass


def worker_environ(launcher: Mapping[str, str], current: Mapping[str, str],
                   server: Mapping[str, str] | None) -> dict[str, str]:
    """A forked worker's environment: the ``launcher``'s, under the variables the agent set in this
    process (those of ``current`` that differ from the ``server``'s environment). ``server`` None:
    this process did not fork from a server that preloaded this module (``spawn``), and it started
    with the launcher's environment under the agent's already: it keeps ``current`` and gains what
    it lacks."""
    if server is None:
        agent = dict(current)
    else:
        agent = {k: v for k, v in current.items() if server.get(k) != v}
    return {**launcher, **agent}


def apply_omp_threads() -> None:
    """``OMP_NUM_THREADS`` of this process's environment as torch's intra-op threads: a process forked
    from one that imported torch has the pool size that process's OpenMP read at import."""
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def platform_start_method() -> None:
    """Give this worker the ``multiprocessing`` start method of a process that python started (fork on Linux
    before Python 3.14), as a worker of torchrun has. A process started by spawn or a forkserver inherits its
    launcher's method (``multiprocessing.spawn.prepare``): a ``DataLoader``'s worker processes would then each
    start a new interpreter, or a forkserver of this rank's own that imports torch again: seconds per worker at
    every epoch, where a fork takes milliseconds."""
    multiprocessing.set_start_method(None, force=True)  # None: the platform's default, chosen at first use


def train_worker(argv: list[str], environ: dict[str, str]) -> None:
    """One worker of ``paratrain train`` (what ``python -m paratrain train ARGV`` would run), in a
    process forked from the server. ``environ`` is the launching command's environment: it replaces
    the one the server started with, under the variables torchrun's agent set for this worker
    (``RANK``, ``TORCHELASTIC_*``...), just as a new interpreter would get ``{**environ, **agent's}``.
    The worker ends when the agent named by ``PARATRAIN_AGENT_PID`` in ``environ`` does."""
    for sig in SERVER_IGNORES:  # what the server ignores, a worker does not (a stop signal: env.preemption)
        signal.signal(sig, signal.SIG_DFL)
    merged = worker_environ(environ, dict(os.environ), None if os.getpid() == _IMPORTED_IN else _SERVER_ENV)
    os.environ.clear()
    os.environ.update(merged)  # with AGENT_PID: the worker ends with the agent (env.process.die_with_launcher)
    apply_omp_threads()
    platform_start_method()  # a DataLoader's workers fork, as in a worker torchrun started
    sys.argv = ["paratrain", *argv]
    from ..cli.main import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)
