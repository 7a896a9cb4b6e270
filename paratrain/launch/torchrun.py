"""``paratrain.launch.torchrun``: a thin layer over PyTorch's ``torchrun`` (``torch.distributed.run``).

Nothing here re-implements the elastic agent or the rendezvous: :func:`torchrun` builds the
argument list ``torchrun`` would get and runs it with ``torch.distributed.run`` in this process.
What it adds:

* safe single-node defaults: nothing listens beyond this machine. torchrun's c10d rendezvous
  keeps its state in a ``FileStore`` in a private temporary folder (its ``store_type=file``
  option) instead of a ``TCPStore``, which would listen on every interface; workers get
  ``--local-addr 127.0.0.1``, so ``MASTER_ADDR`` is loopback, rank 0's process-group store binds
  127.0.0.1 (:func:`paratrain.env.network.loopback_store`) and gloo's sockets use ``lo``;
* environment defaults (``setdefault``, a user's own value wins): ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (the rendezvous TCP store shared with the workers is flaky across restarts) and, when the
  rendezvous address is loopback, ``GLOO_SOCKET_IFNAME=lo``;
* one line on stderr instead of a traceback when a worker or the rendezvous fails, and the
  failing worker's exit code as the return value (a collective timeout names the rank that did
  not arrive, see :func:`paratrain.env.failures.explain_timeout`);
* a frozen worker is woken once torchrun has asked it to terminate (:class:`~paratrain.launch.wake.WakeStopped`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..env import preemption
from ..env.network import free_port, is_loopback
from .logs import WorkerLogs
from .reports import one_line, failure_line, restart_lines
from ..trace.recorder import TRACE_DIR, read_dir
from .wake import WakeStopped

__all__ = ["LaunchConfig", "PASSTHROUGH", "nproc_per_node", "torchrun"]

# torchrun's own flags that paratrain hands to its parser unchanged (``--no-python`` only where
# the user's program is run: ``paratrain run``).
PASSTHROUGH = ("--rdzv-conf", "--start-method", "--tee", "--redirects", "--local-ranks-filter", "--role", "--logs-specs",
               "--event-log-handler", "--numa-binding", "--signals-to-handle", "--shutdown-timeout",
               "--virtual-local-rank", "--duplicate-stdout-filters", "--duplicate-stderr-filters")

# The rendezvous id of a single-node job's private rendezvous: new for every invocation, so it
# names no job that could be restarted on a new membership (see paratrain.loop.train).
PRIVATE_RDZV_ID = "paratrain-private-"


def _min_max_nodes(nnodes: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> ``(min, max)``; ``ValueError`` naming the value otherwise."""
    parts = nnodes.split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        lo, hi = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ValueError(f"nnodes={nnodes!r} is not a number of nodes: use N or MIN:MAX, e.g. 2 or 1:4") from None
    if not 0 < lo <= hi:
        raise ValueError(f"nnodes={nnodes!r} needs 0 < MIN <= MAX: use e.g. 2 or 1:4")
    return lo, hi


def nproc_per_node(value: str) -> int:
    """Workers per node from ``N``, ``auto``, ``cpu`` or ``gpu``, resolved as torchrun resolves
    them (its own ``determine_local_world_size``); ``ValueError`` in one line otherwise."""
    if value.strip().lstrip("-").isdigit():
        n = int(value)
        if n < 1:
            raise ValueError(f"--nproc-per-node {value!r} must be at least 1")
        return n
    if value not in ("auto", "cpu", "gpu"):
        raise ValueError(f"--nproc-per-node {value!r} is not a number of workers: use N, auto, cpu or gpu")
    from torch.distributed.run import determine_local_world_size

    logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)
    try:
        return int(determine_local_world_size(value))
    except ValueError as e:  # "Cuda is not available."
        raise ValueError(f"--nproc-per-node {value}: {one_line(e).rstrip('.')}: use a number or cpu") from None


def _endpoint_host(endpoint: str) -> str:
    """Host part of ``HOST``, ``HOST:PORT`` or ``[IPv6]:PORT``."""
    if endpoint.startswith("["):
        return endpoint[1:endpoint.find("]")]
    return endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 else endpoint


@dataclass
class LaunchConfig:
    """What ``torchrun`` needs to start this node's workers (names follow ``torchrun``'s flags).

    Single node (``nnodes="1"``) with no ``master_*``/``rdzv_endpoint`` binds to loopback. Several
    nodes need either ``master_addr`` (+ ``master_port``): static rendezvous, node ``node_rank``;
    or ``rdzv_endpoint``: c10d (or ``rdzv_backend``) rendezvous, ranks assigned on arrival.
    """

    nproc_per_node: int = 1
    nnodes: str = "1"  # "N" or "MIN:MAX" (elastic)
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    monitor_interval: float | None = None
    local_addr: str | None = None
    log_dir: str | None = None
    standalone: bool = False  # torchrun's --standalone: one node, rendezvous on this machine only
    torchrun_args: list[str] = field(default_factory=list)  # torchrun's own flags, as --flag=value

    def __post_init__(self) -> None:
        if isinstance(self.nnodes, int):  # tolerate LaunchConfig(nnodes=2)
            self.nnodes = str(self.nnodes)
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node={self.nproc_per_node} must be at least 1")
        _, max_nodes = _min_max_nodes(self.nnodes)
        if not 0 <= self.node_rank < max_nodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, {max_nodes}) for nnodes={self.nnodes}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port} is not a TCP port: use 1..65535")
        if self.master_addr == "" or self.rdzv_endpoint == "":
            raise ValueError("master_addr and rdzv_endpoint must not be empty: leave them out instead")
        if self.rdzv_endpoint and (self.master_addr or self.master_port):
            raise ValueError(
                f"rdzv_endpoint={self.rdzv_endpoint!r} and master_addr/master_port both given: use one of them"
            )
        if self.standalone and (max_nodes > 1 or self.master_addr or self.master_port or self.rdzv_endpoint):
            raise ValueError("--standalone is one node with its rendezvous on this machine: leave out --nnodes, "
                             "--master-addr/--master-port and --rdzv-endpoint, or drop --standalone")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be >= 0")
        if self.monitor_interval is not None and self.monitor_interval <= 0:
            raise ValueError(f"monitor_interval={self.monitor_interval} must be > 0 seconds")
        static = self.rdzv_backend in (None, "static")
        if max_nodes > 1 and not self.rdzv_endpoint and not static and self.master_addr:
            raise ValueError(f"rdzv_backend={self.rdzv_backend!r} meets at --rdzv-endpoint HOST:PORT, not at --master-addr: "
                             f"give --rdzv-endpoint {self.master_addr}:{self.master_port or 29400} instead, or drop "
                             "--rdzv-backend for a static rendezvous at --master-addr")
        if max_nodes > 1 and not self.rdzv_endpoint and not (static and self.master_addr):
            raise ValueError(
                f"nnodes={self.nnodes} needs --master-addr/--master-port (static) or --rdzv-endpoint HOST:PORT (c10d) "
                "so the nodes can find each other"
            )
        if not static and self.rdzv_backend != "c10d" and not self.rdzv_endpoint:
            raise ValueError(f"rdzv_backend={self.rdzv_backend!r} needs --rdzv-endpoint HOST:PORT")

    @property
    def min_nodes(self) -> int:
        """Fewest nodes the job starts with (``MIN`` of ``nnodes``)."""
        return _min_max_nodes(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        """Most nodes the job may grow to (``MAX`` of ``nnodes``)."""
        return _min_max_nodes(self.nnodes)[1]

    @property
    def rendezvous_host(self) -> str:
        """Address the rendezvous (or rank 0's store) is reached at."""
        if self.rdzv_endpoint:
            return _endpoint_host(self.rdzv_endpoint)
        return self.master_addr or "127.0.0.1"


def local_addr_of(argv: list[str]) -> str:
    """The ``--local-addr`` of a torchrun command line (what ``MASTER_ADDR`` will be on the rank-0 node),
    else the wildcard address."""
    return next((a.split("=", 1)[1] for a in argv if a.startswith("--local-addr=")), "")


@contextlib.contextmanager
def _master_ports_outside_the_ephemeral_range(host: str) -> Iterator[None]:
    """While the agent runs, each rendezvous round's ``MASTER_PORT`` is :func:`free_port`'s.

    With the rendezvous store not shared (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, above) the agent
    picks each round's ``MASTER_PORT`` with ``bind(0)`` and closes it, and rank 0 binds it seconds
    later, once the workers have started. ``bind(0)`` hands out the same ports to every other
    process here (gloo's listeners, another job's agent), so a restart could find its port taken
    ("rank 0 cannot listen ... Address already in use"). :func:`free_port` picks outside the
    kernel's ephemeral range, where nothing lands by chance. torch's function is put back after."""
    import torch.distributed.elastic.rendezvous.api as api

    original = getattr(api, "get_free_port", None)
    if original is None:  # another torch: its own choice
        yield
        return
    api.get_free_port = lambda: free_port(host or "0.0.0.0")  # type: ignore[attr-defined]
    try:
        yield
    finally:
        api.get_free_port = original  # type: ignore[attr-defined]


def _torchrun_argv(cfg: LaunchConfig, program: list[str], module: bool, supported: set[str],
                   store_dir: str | None = None) -> list[str]:
    """The ``torchrun`` command line (without ``torchrun`` itself) for ``cfg``; a single-node
    default rendezvous keeps its store in a file in ``store_dir`` (a TCP store on loopback without)."""
    argv = [
        f"--nnodes={cfg.nnodes}",
        f"--nproc-per-node={cfg.nproc_per_node}",
        f"--node-rank={cfg.node_rank}",
        f"--max-restarts={cfg.max_restarts}",
    ]
    backend, rdzv_id = cfg.rdzv_backend, cfg.rdzv_id
    single_default = cfg.max_nodes == 1 and not (
        cfg.master_addr or cfg.master_port or cfg.rdzv_endpoint
    )
    if single_default:
        if backend == "static":  # asked for explicitly: static on loopback (its agent's TCPStore binds every interface)
            argv += ["--master-addr=127.0.0.1", f"--master-port={free_port('127.0.0.1')}"]
        else:
            backend, rdzv_id = "c10d", rdzv_id or f"{PRIVATE_RDZV_ID}{uuid.uuid4().hex}"
            if store_dir is not None:
                conf = ",".join(["store_type=file", *_user_rdzv_conf(cfg)])
                argv += [f"--rdzv-endpoint={os.path.join(store_dir, 'rendezvous')}", f"--rdzv-conf={conf}"]
            else:
                argv.append(f"--rdzv-endpoint=127.0.0.1:{free_port('127.0.0.1')}")
    elif cfg.rdzv_endpoint:
        backend = backend or "c10d"
        argv.append(f"--rdzv-endpoint={cfg.rdzv_endpoint}")
    else:
        if cfg.master_addr:
            argv.append(f"--master-addr={cfg.master_addr}")
        if cfg.master_port is not None:
            argv.append(f"--master-port={cfg.master_port}")
    if backend:
        argv.append(f"--rdzv-backend={backend}")
    if rdzv_id:
        argv.append(f"--rdzv-id={rdzv_id}")
    host = cfg.rendezvous_host
    local_addr = cfg.local_addr or (("127.0.0.1" if host == "localhost" else host) if is_loopback(host) else None)
    if local_addr and "--local-addr" in supported:  # older torch has no --local-addr
        argv.append(f"--local-addr={local_addr}")
    if cfg.monitor_interval is not None:
        argv.append(f"--monitor-interval={cfg.monitor_interval}")
    if cfg.log_dir:
        argv.append(f"--log-dir={cfg.log_dir}")
    if module:
        argv.append("--module")
    if any(a.startswith("--rdzv-conf=store_type=file") for a in argv):  # the user's conf is merged into ours
        argv += [a for a in cfg.torchrun_args if not a.startswith("--rdzv-conf=")]
    else:
        argv += cfg.torchrun_args
    return argv + list(program)


def _user_rdzv_conf(cfg: LaunchConfig) -> list[str]:
    return [a.split("=", 1)[1] for a in cfg.torchrun_args if a.startswith("--rdzv-conf=") and a != "--rdzv-conf="]


def _set_threads(nproc_per_node: int) -> None:
    """Intra-op threads per worker: this node's cores shared by its workers (a user's
    ``OMP_NUM_THREADS`` wins). Said in one line, instead of torchrun's four-line banner."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, nproc_per_node))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if nproc_per_node > 1:
        print(f"paratrain: OMP_NUM_THREADS={threads} per worker ({cores} cores / {nproc_per_node} workers on this "
              "node; set OMP_NUM_THREADS to choose)", file=sys.stderr, flush=True)


def _run_function(trun: Any, args: Any, worker: Callable[..., Any], worker_args: tuple, cfg: LaunchConfig) -> None:
    """``torch.distributed.run.run(args)`` with ``worker`` as the entrypoint: the launch config
    torchrun builds from ``args``, handed to its ``elastic_launch`` with the function."""
    import multiprocessing

    from torch.distributed.launcher.api import elastic_launch

    from ..env.process import AGENT_PID
    from .forkserver import ensure_running

    if not any(a.startswith("--start-method=") for a in cfg.torchrun_args) and "PET_START_METHOD" not in os.environ:
        # forkserver where the platform has one (not Windows): new interpreters otherwise
        args.start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if args.start_method == "forkserver":
        ensure_running()  # started already when the command began (paratrain/__init__), else now
    if args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None \
            and trun.parse_min_max_nnodes(args.nnodes)[1] == 1:  # as torchrun's run() does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = trun.config_from_args(args)
    environ = {**os.environ, AGENT_PID: str(os.getpid())}  # the workers end with this process
    elastic_launch(config=config, entrypoint=worker)(*worker_args, environ)


def check_resolvable(host: str) -> None:
    """Fail in one line when ``host`` has no address: c10d would otherwise retry forever."""
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        raise ValueError(f"address {host!r} does not resolve ({e.strerror or e}): "
                         "give the master/rendezvous host as a name this machine can look up, or an IP") from None


def torchrun(cfg: LaunchConfig, program: list[str], module: bool = False, command: str = "run",
             worker: Callable[..., Any] | None = None, worker_args: tuple = (),
             resumes_from: Callable[[], int | None] | None = None, trace_dir: str | None = None,
             logs_dir: str | None = None) -> int:
    """Run ``program`` (``[script.py, *args]``, or ``[module, *args]`` with ``module``) under torchrun.

    With ``worker``, each worker runs ``worker(*worker_args, environ)`` instead, ``environ`` being
    this process's environment when the workers start (torchrun's elastic agent with a function
    entrypoint, as ``torch.distributed.launcher.api.elastic_launch`` takes one), started by
    ``--start-method`` (default ``forkserver``: forked from a server that imported torch once, see
    :mod:`paratrain.launch.forkserver`); ``program`` then only names the job.

    Blocks until every worker on this node has finished. Returns 0 on success; on a worker failure
    prints one line naming the failed rank(s), exit code and root cause (recorded when the script
    uses ``torch.distributed.elastic.multiprocessing.errors.record``) and returns that exit code
    (``128 + signal`` when killed by a signal, else at least 1). Each restart (``max_restarts``)
    is one line too, naming the rank that failed and, with ``resumes_from`` (a function giving the
    step of the checkpoint the restarted workers resume from, None for none), that step.
    ``trace_dir``: where the workers keep their records of their collectives (``paratrain doctor``
    reads them; default: the run's private folder, removed at the end). ``logs_dir``: where each
    worker's output is kept as well (``rank-N.log``, :mod:`.logs`), named by the failure line; not
    where the user passes torchrun's own ``--redirects``/``--tee``.
    """
    if not program:
        raise ValueError("no program to run: give a script path (or a module with -m) and its arguments")
    prefix = f"paratrain {command}: error:"
    check_resolvable(cfg.rendezvous_host)
    import torch.distributed.run as trun
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    parser = trun.get_args_parser()
    parser.allow_abbrev = False
    # Only the launcher's part goes through torchrun's parser: the program's own arguments
    # (``--nproc 7``, ``--help``...) are set afterwards, untouched.
    store_dir = tempfile.mkdtemp(prefix="paratrain-rdzv-")  # private (0700): the rendezvous' FileStore
    argv = _torchrun_argv(cfg, program[:1], module, set(parser._option_string_actions), store_dir)
    own = ("--redirects", "--tee", "-r", "-t")
    if any(a.split("=")[0] in own for a in cfg.torchrun_args):
        logs_dir = None  # the user's own redirection wins
    logs = None
    if logs_dir is not None:
        source = cfg.log_dir or os.path.join(store_dir, "torchelastic")  # where the agent redirects the output
        argv[-1:-1] = ["--redirects=3"] + ([] if cfg.log_dir else [f"--log-dir={source}"])
        first = cfg.node_rank * cfg.nproc_per_node if cfg.max_nodes > 1 else 0
        logs = WorkerLogs(source, logs_dir, lambda local: first + local)
    # a preemption signal reaches the workers, and the agent waits for their checkpoint (env.preemption)
    stopped_dir = os.path.join(store_dir, "stopped")
    own_trace = TRACE_DIR not in os.environ  # the workers' records of their collectives (the user's folder wins)
    trace_dir = os.environ.setdefault(TRACE_DIR, trace_dir or os.path.join(store_dir, "trace"))
    flags = preemption.agent_flags(cfg.torchrun_args, stopped_dir)
    argv[-1:-1] = [f for f in flags if f.split("=")[0] in parser._option_string_actions]
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    _set_threads(cfg.nproc_per_node)
    if not os.environ.get("PARATRAIN_LAUNCH_LOGS"):
        # The agent's own warnings ("Sending process ... closing signal") repeat what the one line
        # below says; PARATRAIN_LAUNCH_LOGS=1 keeps them.
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process ..."
        logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)  # "Received 15 death signal"
    if is_loopback(cfg.rendezvous_host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not any(a.startswith("--rdzv-conf=store_type=file") for a in argv):  # the agent's rendezvous is torch's TCPStore server
        print(f"paratrain: note: the rendezvous store at {cfg.rendezvous_host} listens on all interfaces and accepts "
              "any client (torch's TCPStore): run multi-node jobs on a trusted network", file=sys.stderr, flush=True)
    try:
        args = parser.parse_args(argv)
        args.training_script_args = list(program[1:])
        with WakeStopped(), preemption.LauncherSignals(stopped_dir), restart_lines(resumes_from), \
                _master_ports_outside_the_ephemeral_range(local_addr_of(argv)):
            if logs is not None:
                logs.start()
            try:
                if worker is None:
                    from ..env.process import AGENT_PID

                    os.environ[AGENT_PID] = str(os.getpid())  # the script's workers: their launcher is this process
                    trun.run(args)
                else:
                    _run_function(trun, args, worker, worker_args, cfg)
            finally:
                if logs is not None:
                    logs.stop()  # every line shown and kept before the launcher's own last line
    except ChildFailedError as e:
        if preemption.read_reports(stopped_dir) is not None:  # a worker got the signal itself: saved, stopped
            return preemption.PREEMPTED_EXIT_CODE
        line, rc = failure_line(e, prefix, read_dir(trace_dir), logs.path if logs is not None else None)
        print(line, file=sys.stderr, flush=True)
        return rc
    except (RendezvousError, DistError) as e:  # DistError: the TCP store cannot bind, connect or time out
        print(f"{prefix} rendezvous at {cfg.rendezvous_host} failed: {type(e).__name__}: {one_line(e)}",
              file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        if preemption.read_reports(stopped_dir) is not None:  # the workers saved and printed the line
            return preemption.PREEMPTED_EXIT_CODE
        print(f"{prefix} stopped by {e.sigval.name}; workers were terminated", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    finally:
        stopped = preemption.read_reports(stopped_dir)  # workers that learnt of a signal elsewhere end with 0
        shutil.rmtree(store_dir, ignore_errors=True)
        if own_trace:
            os.environ.pop(TRACE_DIR, None)
    return 0 if stopped is None else preemption.PREEMPTED_EXIT_CODE
