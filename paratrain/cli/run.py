"""``paratrain run``: start a training script on N workers per node, through PyTorch's torchrun.

Flags are spelled like ``torchrun``'s (``--nproc-per-node``, also ``--nproc_per_node``). One node:
``paratrain run --nproc-per-node 4 train.py --lr 0.1``. Several nodes: the same command on every
node with ``--nnodes N --node-rank K --master-addr A --master-port P`` (static rendezvous) or with
``--nnodes MIN:MAX --rdzv-endpoint HOST:PORT`` (c10d rendezvous).

``--strategy``, ``--precision`` and ``--set parallel.KEY=VALUE`` set the defaults of every
``Parallel()`` the script builds (``paratrain run --strategy ddp --precision bf16-mixed train.py``);
so does the ``[parallel]`` table of a ``paratrain.toml`` in the working directory (or of
``--config FILE``). The arguments the script passes to ``Parallel(...)`` win over them, then the
command line, then the file, then the built-in defaults. ``paratrain env`` shows those in force.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
from typing import Any

from .. import precision, strategies
from ..config import parallel_defaults, parse_set
from ..env import defaults as launch_defaults
from ..env import preemption
from ..launch.torchrun import PASSTHROUGH, LaunchConfig, nproc_per_node, torchrun


def add_launch_arguments(p: argparse.ArgumentParser, *, program: bool = False) -> None:
    """Add torchrun's launch flags (workers, nodes, rendezvous, restarts) to ``p``; see :func:`launch_config`.

    ``program``: the command runs the user's program (``paratrain run``), so torchrun's
    ``--no-python`` applies too."""
    g = p.add_argument_group("launch (torchrun)")
    g.add_argument("--nproc-per-node", "--nproc_per_node", type=_nproc, default=_env("NPROC_PER_NODE", 1), metavar="N|auto|cpu|gpu",
                   help="workers on this node: a number, or auto (one per GPU, else per CPU core), cpu, gpu "
                        "(default %(default)s)")
    g.add_argument("--standalone", action="store_true", default=_env("STANDALONE", "") not in ("", "0"),
                   help="one node, rendezvous on this machine only (the default when no address is given)")
    g.add_argument("--nnodes", default=_env("NNODES", "1"), metavar="M|MIN:MAX", help="number of nodes (default 1)")
    g.add_argument("--node-rank", "--node_rank", type=int, default=_env("NODE_RANK", 0), metavar="K",
                   help="this node's rank, for static rendezvous (default 0)")
    g.add_argument("--master-addr", "--master_addr", default=_env("MASTER_ADDR"), metavar="A",
                   help="address of node 0 (static rendezvous)")
    g.add_argument("--master-port", "--master_port", type=int, default=_env("MASTER_PORT"), metavar="P",
                   help="port on node 0 (static rendezvous)")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=_env("RDZV_ENDPOINT"), metavar="HOST:PORT",
                   help="c10d rendezvous endpoint (instead of --master-addr/--master-port)")
    g.add_argument("--rdzv-backend", "--rdzv_backend", default=_env("RDZV_BACKEND"), metavar="B",
                   help="rendezvous backend (default: static with --master-addr, c10d otherwise)")
    g.add_argument("--rdzv-id", "--rdzv_id", default=_env("RDZV_ID"), metavar="ID", help="job id shared by all nodes")
    g.add_argument("--max-restarts", "--max_restarts", type=int, default=_env("MAX_RESTARTS", 0), metavar="R",
                   help="restart the worker group up to R times after a failure (default 0)")
    g.add_argument("--monitor-interval", "--monitor_interval", type=float, default=_env("MONITOR_INTERVAL"), metavar="S",
                   help="seconds between worker health checks")
    g.add_argument("--local-addr", "--local_addr", default=_env("LOCAL_ADDR"), metavar="A", help="this node's address")
    g.add_argument("--preempt-grace-s", type=float, default=None, metavar="S",
                   help="seconds that a preemption signal (SIGTERM, SIGUSR1) leaves the workers to finish their step "
                        "and save a checkpoint before they exit with code 75 (default 60; $PARATRAIN_PREEMPT_GRACE_S)")
    _add_torchrun_flags(g, PASSTHROUGH + (("--no-python",) if program else ()))


def _env(name: str, default: Any = None) -> Any:
    """torchrun's default for a launch flag: ``PET_<NAME>`` when set (as the Kubeflow PyTorchJob
    operator passes them), else ``default``. argparse converts a string default with the flag's type."""
    return os.environ.get(f"PET_{name}", default)


def _nproc(value: str) -> int:
    try:
        return nproc_per_node(value)
    except ValueError as e:  # argparse prints an ArgumentTypeError's own text
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--nproc-per-node {value!r} ")) from None


def _add_torchrun_flags(group: Any, names: tuple[str, ...]) -> None:
    """torchrun's own definitions of ``names`` (help, choices, defaults), their values handed to
    torchrun's parser as given: ``args.torchrun_flags`` lists ``(flag, value)`` in order."""
    import torch.distributed.run as trun

    actions = trun.get_args_parser()._option_string_actions
    for name in names:
        if name not in actions:  # an older torch without this flag
            continue
        action = copy.copy(actions[name])
        if action.nargs != 0:
            action.metavar = action.metavar or action.dest.upper()
        action.dest = "torchrun_" + action.dest
        action.default = argparse.SUPPRESS
        if action.help:
            action.help = action.help.split(". ")[0].rstrip(".") + " (torchrun's flag, passed to it)"
        group._add_action(action)


def torchrun_flags(args: argparse.Namespace) -> list[str]:
    """``--flag=value`` (``--flag`` for switches) for each of torchrun's own flags given on the command line."""
    import torch.distributed.run as trun

    out = []
    for action in trun.get_args_parser()._actions:
        value = getattr(args, "torchrun_" + action.dest, None)
        if value is None or value is False or not action.option_strings:
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        flag = next((o for o in action.option_strings if o.startswith("--") and "_" not in o), flag)
        out.append(flag if value is True else f"{flag}={value}")
    return out


def launch_config(args: argparse.Namespace, *, log_dir: str | None = None) -> LaunchConfig:
    """The :class:`LaunchConfig` for flags added by :func:`add_launch_arguments` (validated).
    ``--preempt-grace-s`` goes to the workers' environment (:mod:`paratrain.env.preemption`)."""
    grace = getattr(args, "preempt_grace_s", None)
    if grace is not None:
        if not grace > 0:
            raise ValueError(f"--preempt-grace-s {grace:g} must be a positive number of seconds, e.g. 60")
        os.environ[preemption.GRACE_ENV] = f"{grace:g}"
    return LaunchConfig(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        local_addr=args.local_addr,
        log_dir=log_dir,
        standalone=args.standalone,
        torchrun_args=torchrun_flags(args),
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``paratrain run`` on the top-level subparsers."""
    p = subparsers.add_parser(
        "run",
        help="run a script on N workers per node (torchrun)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_arguments(p, program=True)
    add_default_arguments(p)
    p.add_argument("--log-dir", "--log_dir", default=None, metavar="DIR",
                   help="torchrun log directory; each rank's output is kept in DIR/logs/rank-N.log and its records "
                        "of collectives in DIR/trace (paratrain doctor DIR)")
    p.add_argument("-m", "--module", action="store_true", help="run the program as a module, like python -m")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments for the script, passed to it untouched (also ones named like paratrain's flags)")
    p.set_defaults(func=main, split_program=split_program)
    return p


def add_default_arguments(p: argparse.ArgumentParser) -> None:
    """``--strategy``, ``--precision``, ``--set`` and ``--config``: the defaults of the script's ``Parallel()``."""
    g = p.add_argument_group("defaults of Parallel() in the script (its own arguments win)")
    g.add_argument("--strategy", default=None, metavar="S", help=f"{', '.join(strategies.STRATEGIES)}")
    g.add_argument("--mesh", default=None, metavar="DIM=N,...",
                   help="the layout as mesh sizes, e.g. dp_replicate=2,dp_shard=2 (pp, dp_replicate, dp_shard, tp)")
    g.add_argument("--precision", default=None, metavar="P", help=f"{', '.join(precision.PRECISIONS)}")
    g.add_argument("--check-collectives", action="store_true",
                   help="compare each collective's op, size and dtype across the ranks before it runs, and stop at the "
                        "first difference in one line (a collective more each; parallel.check_collectives)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="parallel.KEY=VALUE",
                   help="any other field of Parallel's config, e.g. --set parallel.seed=3 "
                        "--set parallel.ddp.comm_hook=fp16")
    g.add_argument("--config", default=None, metavar="FILE",
                   help=f"TOML or YAML file whose [parallel] table sets them (default: "
                        f"./{launch_defaults.PROJECT_FILE} if there is one; the format of paratrain train --config)")


def defaults_environment(args: argparse.Namespace) -> dict[str, str]:
    """The environment that hands the script's ``Parallel()`` its defaults (:mod:`paratrain.env.defaults`),
    validated here, before any worker starts; empty when nothing sets one."""
    overrides = parse_set(args.overrides)
    labels = {key: f"paratrain run --set {key}" for key in overrides}
    for flag in ("strategy", "mesh", "precision"):
        if getattr(args, flag) is not None:
            overrides[f"parallel.{flag}"] = getattr(args, flag)
            labels[f"parallel.{flag}"] = f"paratrain run --{flag}"
    if getattr(args, "check_collectives", False):
        overrides["parallel.check_collectives"] = "true"
        labels["parallel.check_collectives"] = "paratrain run --check-collectives"
    table, sources = parallel_defaults(args.config, overrides, labels=labels)
    return launch_defaults.encode(table, sources) if table else {}


def split_program(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``run``'s arguments at the script: ``(launcher args + [script], script args)``.

    argparse would read a script argument such as ``--nproc 7`` or ``--help`` as one of the
    launcher's own flags (or as an abbreviation of one); everything after the script name belongs
    to the script, so it is cut off before parsing. ``--`` before the script is accepted too.
    """
    actions = parser._option_string_actions
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return argv[:i] + argv[i + 1:i + 2], argv[i + 2:]
        if not tok.startswith("-") or tok == "-":
            return argv[:i + 1], argv[i + 1:]
        name = tok.split("=", 1)[0]
        action = actions.get(name)
        if action is not None and action.nargs != 0 and "=" not in tok:
            i += 1  # the flag's value
        i += 1
    return argv, []


def main(args: argparse.Namespace) -> int:
    """Validate the arguments, then run torchrun; returns its exit code."""
    cfg = launch_config(args, log_dir=args.log_dir)
    if not args.script:
        raise ValueError("no script given: paratrain run [launch flags] script.py [script args]")
    if getattr(args, "torchrun_no_python", False):
        if args.module:
            raise ValueError("--no-python and -m both given: -m runs a Python module, --no-python a program; use one")
        if not (os.path.isfile(args.script) or shutil.which(args.script)):
            raise FileNotFoundError(f"program {args.script!r} is neither a file nor on PATH: give a path or a command")
    elif not args.module and not os.path.isfile(args.script):
        raise FileNotFoundError(f"script {args.script!r} does not exist: give the path to a Python file (or use -m)")
    os.environ.update(defaults_environment(args))  # torchrun hands this process's environment to the workers
    return torchrun(cfg, [args.script, *args.script_args], module=args.module,
                    trace_dir=os.path.join(args.log_dir, "trace") if args.log_dir else None,  # for paratrain doctor
                    logs_dir=os.path.join(args.log_dir, "logs") if args.log_dir else None)  # each rank's output
