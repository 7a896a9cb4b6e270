"""``paratrain train``: train a built-in task (model × dataset) on N workers.

Configuration comes from a TOML/YAML file (``--config``), then the flags below, then ``--set
section.key=value`` overrides. With ``--nproc-per-node N`` (or ``--nnodes``) the command starts
its own workers through torchrun; under an existing launcher (``torchrun``, ``paratrain run``,
Slurm's ``srun``, ``mpirun``) it runs as one of the workers, unless it is the one task on its node
and ``--nproc-per-node`` asks for more: then it starts that node's workers (see :func:`_role`).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import sys
import time
from typing import Any, Iterable

from ..checkpoint.io import newest_step
from ..config import TrainConfig, parse_set, to_toml
from ..data.datasets import DATASET_NAMES
from ..env import defaults as launch_defaults
from ..env import preemption
from ..env.detect import detect_process
from ..env.disk import StorageError, writing
from ..env.lock import LOCK_FILE, FolderLock, lock_folder
from ..env.network import is_loopback
from ..env.devices import select_backend, select_device
from ..launch.torchrun import LaunchConfig, torchrun
from ..models.registry import MODEL_NAMES
from ..strategies import AUTO, STRATEGIES
from ..tracking.runs import LATEST, latest_run, new_run_dir
from .run import add_launch_arguments, launch_config


def _one_of(names: Iterable[str]) -> str:
    """``"a, b or c"``."""
    *rest, last = names
    return f"{', '.join(rest)} or {last}" if rest else last


# flag -> dotted config key
_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--model": ("model", str, f"{', '.join(MODEL_NAMES)}, torchvision:<name>, or your own factory as "
                "file.py:function or module:function"),
    "--dataset": ("data.dataset", str, f"{', '.join(DATASET_NAMES)} (digits ships with paratrain), or your own "
                  "factory as file.py:function or module:function"),
    "--data-dir": ("data.data_dir", str, "folder holding cifar-10-batches-py"),
    "--strategy": ("parallel.strategy", str, _one_of([AUTO, *STRATEGIES])),  # the registry's names
    "--mesh": ("parallel.mesh", str, "the layout as mesh sizes, e.g. dp_replicate=2,dp_shard=2 or pp=2,tp=2 (pp, "
               "dp_replicate, dp_shard, tp; one may be -1: the rest)"),
    "--precision": ("parallel.precision", str, "32, tf32, fp16-mixed, bf16-mixed, bf16-true, fp16-true, O0-O3"),
    "--global-batch": ("parallel.global_batch", int, "samples per optimizer step over all workers"),
    "--accumulation": ("parallel.accumulation", int, "micro-steps per optimizer step"),
    "--micro-batch": ("parallel.micro_batch", int, "samples per worker per forward"),
    "--loss-scale": ("parallel.loss_scale", float, "static fp16 loss scale (default dynamic)"),
    "--clip-grad-norm": ("parallel.clip_grad_norm", float, "clip the global gradient norm"),
    "--comm-hook": ("parallel.ddp.comm_hook", str, "ddp gradient compression: none, fp16, bf16, powersgd"),
    "--seed": ("parallel.seed", int, "seed for init, data order and augmentation"),
    "--backend": ("parallel.backend", str, "auto, gloo, nccl or mpi"),
    "--epochs": ("epochs", int, "epochs to train"),
    "--max-steps": ("max_steps", int, "stop after this many optimizer steps"),
    "--lr": ("optim.lr", float, "learning rate (before linear scaling)"),
    "--optimizer": ("optim.name", str, "sgd or adamw"),
    "--warmup-steps": ("optim.warmup_steps", int, "linear LR warmup steps"),
    "--schedule": ("optim.schedule", str, "LR after warmup: constant, cosine, linear or step (optim.step_size, optim.gamma)"),
    "--base-batch": ("optim.base_batch", int, "linear scaling rule: lr x global_batch/base_batch"),
    "--num-workers": ("data.num_workers", int, "DataLoader worker processes"),
    "--log-dir": ("log_dir", str, "where metrics CSV/JSONL and result.json go"),
    "--checkpoint-every": ("checkpoint_every", int, "checkpoint every N optimizer steps"),
    "--checkpoint-dir": ("checkpoint_dir", str, "checkpoint folder (default <log-dir>/checkpoints)"),
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a built-in task on N workers", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="TOML or YAML config file (default: ./paratrain.toml, if there is one)")
    defaults = TrainConfig()
    for flag, (key, tp, help_) in _FLAGS.items():
        # default=None: a flag not given leaves the config file's value; the help shows the built-in default.
        p.add_argument(flag, dest=key, type=tp, default=None, help=f"{help_} [{key}; default {_default(defaults, key)}]")
    p.add_argument("--checkpoint-async", dest="checkpoint_async", action="store_const", const=True, default=None,
                   help="write checkpoints in the background while training goes on [checkpoint_async]")
    p.add_argument("--sync-bn", dest="parallel.sync_batchnorm", action="store_const", const=True, default=None,
                   help="synchronise BatchNorm statistics across workers")
    p.add_argument("--check-collectives", dest="parallel.check_collectives", action="store_const", const=True,
                   default=None, help="compare each collective across the ranks before it runs: one line at the first "
                                      "difference [parallel.check_collectives]")
    p.add_argument("--name", dest="name", default=None,
                   help="the run's name: it writes to runs/<name> (default: the start time, runs/20250101-120000)")
    p.add_argument("--resume", dest="resume", nargs="?", const=True, default=None, metavar="RUN",
                   help="continue the run in folder RUN (default: runs/latest, or runs/<--name>) from its newest "
                        "checkpoint (automatic after a torchrun restart)")
    p.add_argument("--no-progress", dest="progress", action="store_const", const=False, default=None,
                   help="no progress bar")
    p.add_argument("--log-to", dest="log_to", default=None, metavar="LIST",
                   help="where metrics go, comma-separated: csv, tensorboard, wandb, mlflow, comet [log_to; default csv]")
    p.add_argument("--tensorboard", dest="tensorboard", action="store_const", const=True, default=None,
                   help="also write TensorBoard event files to <log-dir>/tensorboard (the same as adding "
                        "tensorboard to --log-to; needs tensorboard)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set parallel.ddp.bucket_cap_mb=50")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as TOML (what --config reads back) and exit")
    add_launch_arguments(p)
    p.set_defaults(func=main)
    return p


def _default(cfg: TrainConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The job's config: the ``--config`` file, then the flags, then ``--set`` items, validated once."""
    flags = {key: getattr(args, key) for key, *_ in _FLAGS.values()}
    flags["parallel.sync_batchnorm"] = getattr(args, "parallel.sync_batchnorm")
    flags["progress"] = args.progress
    flags["tensorboard"] = getattr(args, "tensorboard", None)  # verify and bench reuse this without the flag
    flags["log_to"] = getattr(args, "log_to", None)
    flags["name"] = getattr(args, "name", None)
    flags["resume"] = args.resume
    if isinstance(args.resume, str):  # --resume RUN: that run's folder
        if flags["log_dir"] is not None and os.path.abspath(flags["log_dir"]) != os.path.abspath(args.resume):
            raise ValueError(f"--resume {args.resume!r} and --log-dir {flags['log_dir']!r} name two runs: give one")
        flags["resume"], flags["log_dir"] = True, args.resume
    overrides = {k: v for k, v in flags.items() if v is not None}
    return TrainConfig.load(_config_file(args.config), {**overrides, **parse_set(args.overrides)})


_PROJECT_NOTED = "PARATRAIN_PROJECT_CONFIG"  # set once the notice below is printed: the job's workers stay quiet


def _config_file(given: str | None) -> str | None:
    """``--config``'s file; without it, the project's ``./paratrain.toml`` when there is one (as
    ``paratrain run`` reads its ``[parallel]`` table), said once on the main process."""
    if given is not None or not os.path.isfile(launch_defaults.PROJECT_FILE):
        return given
    if _PROJECT_NOTED not in os.environ and detect_process().rank == 0:
        print(f"paratrain: config from ./{launch_defaults.PROJECT_FILE} (the project's; --config FILE reads another)",
              file=sys.stderr, flush=True)
    os.environ[_PROJECT_NOTED] = os.path.abspath(launch_defaults.PROJECT_FILE)
    return launch_defaults.PROJECT_FILE


def main(args: argparse.Namespace) -> int:
    cfg = build_config(args)  # validate before any process starts
    if getattr(args, "print_config", False):
        print(to_toml(cfg), end="")
        return 0
    worker, launch, per_node = _role(launch_config(args))
    if not worker:
        _check_paths(cfg)  # before the run folder is named: a read-only runs/ is one line too
    # This process holds the folders (env/lock.py) when it starts every worker of the job, from before
    # the first write to the end; else (another launcher, several nodes) rank 0 of the workers does.
    held: list[FolderLock] | None = None if worker or per_node or launch.max_nodes > 1 else []
    try:
        cfg = _pick_run(cfg, worker or per_node, held)  # per node: all nodes name the run after the Slurm/MPI job
        if preemption.slurm_requeued() and not cfg.resume and cfg.log_dir:  # its checkpoints: where --resume reads
            cfg = cfg.with_overrides({"resume": True})
        _hold(held, cfg.checkpoint_dir, "checkpoint folder", "--checkpoint-dir")
        if cfg.log_dir and not os.path.isfile(cfg.log_dir):
            os.environ.setdefault("PARATRAIN_ERROR_DIR", cfg.log_dir)  # tracebacks of one-line errors go there
        return _start(args, cfg, worker, launch)
    finally:
        for lock in reversed(held or []):
            lock.release()


def _start(args: argparse.Namespace, cfg: TrainConfig, worker: bool, launch: LaunchConfig) -> int:
    """Train: as one worker of a launched job, in this process, or on the workers started here."""
    if worker:
        from ..loop.train import run_training

        return _ended(run_training(cfg))  # we are one worker of a launched job
    world = launch.nproc_per_node * launch.min_nodes
    on_world = cfg.parallel.for_world(world)  # strategy "auto": what it stands for on the workers
    on_world.strategy_class.check_world(world)
    _check_machine(cfg)
    plan = on_world.batch_plan(world)  # one-line errors before any worker starts
    plan.steps_per_epoch(cfg.train_size(), f" over {world} process(es)")  # the data fills a global batch
    if world == 1 and launch.max_nodes == 1 and launch.max_restarts == 0:
        from ..loop.train import run_training

        return _ended(run_training(cfg, plan))  # this process trains: the plan is handed down
    # the workers (and their restarts) train into the folder picked here
    run = ["--set", f"name={cfg.name}"] + (["--set", f"log_dir={cfg.log_dir}"] if cfg.log_dir else [])
    # Each worker runs `paratrain train ...` as a function, forked from a server that imported torch
    # (paratrain.launch.forkserver); `--start-method spawn` starts each in a new interpreter instead.
    from ..launch.forkserver import train_worker

    argv = [*args.argv, *run]
    ckpt = cfg.checkpoint_dir
    return torchrun(launch, ["paratrain", *argv], module=True, command="train", worker=train_worker,
                    worker_args=(argv,), resumes_from=(lambda: newest_step(ckpt)) if ckpt else None,
                    trace_dir=os.path.join(cfg.log_dir, "trace") if cfg.log_dir else None,  # for paratrain doctor
                    logs_dir=os.path.join(cfg.log_dir, "logs") if cfg.log_dir else None)  # each rank's output


def _ended(summary: dict[str, Any]) -> int:
    """The exit code of a process that trained: 0, or 75 after a stop signal (``env.preemption``)."""
    return preemption.exit_code() if summary.get("preempted") else 0


def _role(launch: LaunchConfig) -> tuple[bool, LaunchConfig, bool]:
    """``(worker, launch, per_node)``: whether this process is one worker of a job another launcher
    started, the launch config for the workers it starts itself, and whether it starts them as one
    node of a Slurm/MPI step.

    Under torchrun it is a worker. So it is as a task of a Slurm/MPI step of several tasks, unless
    ``--nproc-per-node``/``--nnodes`` ask it to start workers: with one task per node it is then that
    node's launcher (as torchrun under ``srun --ntasks-per-node 1`` is), its node count, rank and
    rendezvous (the first node) from the step where the flags leave them out. With several tasks per
    node each would start its own workers: an error."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True, launch, False
    info = detect_process()
    if info.world_size == 1:
        return False, launch, False
    if launch.nproc_per_node == 1 and launch.max_nodes == 1:
        return True, launch, False
    if info.local_world_size > 1:
        raise ValueError(
            f"{info.source} started {info.local_world_size} tasks on this node, each of them one worker, and "
            f"--nproc-per-node {launch.nproc_per_node} --nnodes {launch.nnodes} asks each to start workers of its own: "
            "drop --nproc-per-node/--nnodes (one task per worker), or start one task per node "
            "(srun --ntasks-per-node 1)")
    nodes: dict[str, Any] = {"nnodes": str(info.world_size)} if launch.nnodes == "1" else {}
    if not launch.rdzv_endpoint:  # static rendezvous: this node's rank is its task's
        nodes["node_rank"] = launch.node_rank or info.rank
        if not launch.master_addr:
            if is_loopback(info.master_addr):
                raise ValueError(f"{info.source} gives no address of the first node (MASTER_ADDR is {info.master_addr}) "
                                 "for one task per node to meet at: give --master-addr or --rdzv-endpoint")
            nodes.update(master_addr=info.master_addr, master_port=launch.master_port or info.master_port)
    return False, dataclasses.replace(launch, **nodes), True


def _pick_run(cfg: TrainConfig, worker: bool, held: list[FolderLock] | None = None) -> TrainConfig:
    """Fill ``{name}`` in the log (``runs/{name}``) and checkpoint folders: ``--name``; with
    ``--resume``, the run ``runs/latest`` points at; else a new folder named by the start time,
    which ``runs/latest`` then points at. Workers of an outside launcher (torchrun, srun) agree on
    the launcher's job id instead (pass ``--name`` where there is none). A requeued Slurm job
    (``SLURM_RESTART_COUNT``) continues its run as ``--resume`` would, or starts one if there is none.

    With ``held`` (a list), the run folder is locked for this run (appended there) before it is
    written to, and a new run refuses a folder that holds a run once it holds the lock."""
    resuming = cfg.resume or preemption.slurm_requeued()
    if not any(path and "{name}" in path for path in (cfg.log_dir, cfg.checkpoint_dir)):
        _hold(held, cfg.log_dir, "log_dir", "--log-dir")
        if cfg.log_dir and not resuming and not worker and _holds_a_run(cfg.log_dir):
            raise ValueError(f"log_dir {cfg.log_dir!r} already holds a run: continue it with --resume {cfg.log_dir}, "
                             "or choose another --log-dir")
        return cfg
    root = (cfg.log_dir or cfg.checkpoint_dir or "").split("{name}")[0].rstrip("/" + os.sep) or "."
    name = cfg.name
    if name is None and resuming:
        latest = latest_run(root)
        if latest is None and cfg.resume:
            raise ValueError(f"--resume: there is no run in {root}/ to resume ({os.path.join(root, LATEST)} does not "
                             "exist): give the run's folder, --resume runs/<name>")
        name = os.path.basename(latest) if latest is not None else None
    if name is None and worker:
        name = _launcher_job_id()
        if name is None and detect_process().world_size > 1:  # each worker would name it by its own clock
            raise ValueError("the workers of this launcher share no job id to name the run folder after (torchrun "
                             "without --rdzv-id, MPICH/Intel MPI's mpiexec): pass --name NAME, or --log-dir")
    if name is not None and cfg.log_dir and "{name}" in cfg.log_dir:
        taken = cfg.log_dir.replace("{name}", name)
        _hold(held, taken, "run folder", "--name")  # the named folder: locked before anything is written there
        if not resuming and not worker and _holds_a_run(taken):
            raise ValueError(f"run folder {taken!r} already holds a run: continue it with --resume {taken}, "
                             "or choose another --name")
        _hold(held, cfg.for_run(name).checkpoint_dir, "checkpoint folder", "--checkpoint-dir")  # before runs/latest moves
    if (name is None or not resuming) and cfg.log_dir and "{name}" in cfg.log_dir \
            and (not worker or detect_process().rank == 0):
        with writing(root, flag="--log-dir"):  # a read-only or full runs/: one line
            name = os.path.basename(new_run_dir(root, name))  # a new run: its folder, and runs/latest points at it
        if cfg.name is None:  # named by the start time: a folder of its own, locked before anything is written there
            _hold(held, cfg.log_dir.replace("{name}", name), "run folder", "--name")
    return cfg.for_run(name or time.strftime("%Y%m%d-%H%M%S"))


def _hold(held: list[FolderLock] | None, folder: str | None, what: str, flag: str) -> None:
    """Lock ``folder`` for this run into ``held`` (nothing when ``held`` is None: another process
    holds the run's folders)."""
    if held is not None and folder is not None and not os.path.isfile(folder):
        lock = lock_folder(folder, what, flag)
        if lock is not None and lock not in held:
            held.append(lock)
        elif lock is not None:
            lock.release()  # the log folder again (checkpoint_dir = log_dir): one hold is enough


def _holds_a_run(folder: str) -> bool:
    """Whether ``folder`` holds a run's files; not only the traceback of a run that failed before
    it started (``error-*.log``) or a lock (``.paratrain.lock``)."""
    return os.path.isdir(folder) and any(not (f.startswith("error-") and f.endswith(".log")) and f != LOCK_FILE
                                         for f in os.listdir(folder))


def _launcher_job_id() -> str | None:
    """An id that every worker of an outside launcher's job sees alike, or None."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    return f"mpi-{os.environ['PMIX_NAMESPACE']}" if os.environ.get("PMIX_NAMESPACE") else None  # OpenMPI 4/5


def _check_paths(cfg: TrainConfig) -> None:
    """Fail before starting workers when the log or checkpoint folder cannot be a writable folder."""
    for flag, path in (("--log-dir", cfg.log_dir), ("--checkpoint-dir", cfg.checkpoint_dir)):
        if path is None:
            continue
        probe = os.path.abspath(path)
        while not os.path.exists(probe):  # the nearest part of the path that exists
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            raise ValueError(f"{flag} {path!r} cannot be a folder: {probe!r} is a file; choose another {flag}")
        if _read_only(probe):  # a read-only runs/ (the default --log-dir) is one line too
            raise StorageError(f"{flag} {path!r} cannot be written: {probe!r} is on a read-only filesystem; "
                               f"choose another {flag}", errno.EROFS)
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path!r} cannot be written: no write permission on {probe!r}; "
                             f"choose another {flag}")


def _read_only(folder: str) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _check_machine(cfg: TrainConfig) -> None:
    """Fail before starting workers when the asked-for accelerator or backend is not here."""
    device = select_device(0, cfg.parallel.accelerator)
    select_backend(device, None if cfg.parallel.backend == "auto" else cfg.parallel.backend)

