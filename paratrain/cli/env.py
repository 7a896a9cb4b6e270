"""``paratrain env``: a copy-paste report of this machine for bug reports.

Versions (paratrain, torch and its CUDA/NCCL, python), the devices and what paratrain would pick
on them, the distributed backends torch was built with, the launcher variables that are set
(torchrun, Slurm, MPI), the defaults of ``Parallel()`` in force (set by ``paratrain run
--strategy/--precision/--set``, or a ``paratrain.toml`` here) and where each came from, and the
default ``paratrain train`` config.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
from typing import Any

ENV_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_", "SLURM_", "OMPI_COMM_WORLD_", "PMI_", "MPI_LOCALRANKID", "CUDA_VISIBLE_DEVICES",
                "NCCL_", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "PARATRAIN_", "TORCH_DISTRIBUTED_DEBUG")
OPTIONAL = ("torchvision", "tensorboard", "yaml", "transformers", "datasets", "torchmetrics", "wandb", "mlflow",
            "safetensors")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("env", help="print versions, devices and launcher variables for a bug report",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="show the Parallel() defaults of this file's [parallel] table (default: those set at launch, "
                        "else ./paratrain.toml's)")
    p.set_defaults(func=main)
    return p


def parallel_defaults_lines(config: str | None = None) -> list[str]:
    """The defaults of ``Parallel()`` in force, one line each with where it came from: ``config``'s
    (a file), else those set at launch (``paratrain run``), else ``./paratrain.toml``'s."""
    from ..config import parallel_defaults
    from ..env import defaults as launch_defaults

    table, sources = launch_defaults.read() if config is None else ({}, {})
    if not table:
        table, sources = parallel_defaults(config)
    head = "Parallel() defaults (the script's own arguments win over these; the rest are built-in):"
    if not table:
        return [head, f"  (none set: paratrain run --strategy/--precision/--set, or ./{launch_defaults.PROJECT_FILE})"]
    return [head, *(f"  {key} = {json.dumps(value, default=str)}  ({sources.get(key, launch_defaults.VARIABLE)})"
                    for key, value in launch_defaults.dotted(table).items())]


def report(config: str | None = None) -> str:
    """The report as text."""
    import torch
    import torch.distributed as dist

    from .. import __version__
    from ..config import TrainConfig, to_toml
    from ..env.devices import available_accelerator, select_backend, select_device

    cuda = torch.version.cuda
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.cuda.is_available() else None
    found = available_accelerator()
    if found is None:
        devices = "none available: runs on the CPU" + (f" (this torch is a CUDA {cuda} build)" if cuda else "")
    else:
        kind, count = found
        names = [torch.cuda.get_device_name(i) for i in range(count)] if kind == "cuda" else []
        devices = f"{kind} x{count}" + (f": {', '.join(names)}" if names else "")
    device = select_device(0)
    backends = {name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
                for name in ("gloo", "nccl", "mpi", "xccl")}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        f"paratrain {__version__}",
        f"python {platform.python_version()} ({platform.python_implementation()}) on {platform.platform()}",
        f"torch {torch.__version__}" + (f", CUDA {cuda}" if cuda else ", CPU build")
        + (f", cuDNN {torch.backends.cudnn.version()}" if cuda and torch.backends.cudnn.is_available() else "")
        + (f", NCCL {nccl}" if nccl else ""),
        f"accelerator: {devices}",
        f"paratrain picks: device {device}, backend {select_backend(device)}",
        "torch.distributed backends: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in backends.items()),
        f"CPU: {platform.machine()}, {cores} usable cores; torch threads {torch.get_num_threads()} intra-op, "
        f"{torch.get_num_interop_threads()} inter-op",
        "optional packages: " + ", ".join(f"{m} {'yes' if importlib.util.find_spec(m) else 'no'}" for m in OPTIONAL),
        "launcher variables:",
    ]
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES))
    lines += [f"  {k}={v}" for k, v in env] or ["  (none set)"]
    lines += parallel_defaults_lines(config)
    lines += ["default config (paratrain train --print-config):", *("  " + ln for ln in to_toml(TrainConfig()).splitlines())]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    print(report(args.config))
    return 0
