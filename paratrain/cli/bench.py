"""``paratrain bench``: run a matrix of configurations on one model and data set, print a
comparison table (time per epoch, samples/s, speed-up, scaling efficiency, peak memory, bytes communicated,
overflow skips, final loss, test accuracy), write results.json, results.csv and chart.png, and
recommend the fastest configuration whose accuracy stays within a tolerance of single-device.

The job is a built-in task configured like ``paratrain train`` (``--config``, ``--model``...,
``--set``); the matrix is set with ``--strategies``, ``--world-sizes``, ``--precisions`` and
``--comm-hooks``. Every cell runs in fresh processes with a hard time limit; cells that cannot run
on this machine (DataParallel without GPUs, nccl without CUDA...) are listed with the reason.
``--quick`` is a small matrix that takes about 20 s on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from ..config import TrainConfig, parse_set

# flag -> dotted key of the base TrainConfig
_JOB_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--model": ("model", str, "mlp, cnn, resnet8, resnet20, resnet50, transformer or torchvision:<name>"),
    "--dataset": ("data.dataset", str, "digits (default, bundled), cifar10 or synthetic"),
    "--data-dir": ("data.data_dir", str, "folder holding cifar-10-batches-py"),
    "--global-batch": ("parallel.global_batch", int, "samples per optimizer step (the matrix keeps it)"),
    "--lr": ("optim.lr", float, "learning rate"),
    "--optimizer": ("optim.name", str, "sgd or adamw"),
    "--seed": ("parallel.seed", int, "seed for init and data order"),
}


def _csv(tp: Any) -> Any:
    def parse(text: str) -> list[Any]:
        try:
            return [tp(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {tp.__name__}") from None

    return parse


def _link(flag: str) -> Any:
    def parse(text: str) -> str:
        from ..bench.predict import Link  # startup time: paid only when a link is given, before any cell runs

        try:
            Link.parse(text, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return parse


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="compare strategies, world sizes and precisions on one job",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small matrix: world sizes 1,2, fp32 + bf16, hooks fp16 + powersgd, 2 epochs (~20 s on 2 cores)")
    p.add_argument("--out", default="runs/bench", metavar="DIR", help="where results.json/.csv and chart.png go")
    p.add_argument("--config", metavar="FILE", help="TOML or YAML config of the job (as for paratrain train)")
    for flag, (key, tp, help_) in _JOB_FLAGS.items():
        p.add_argument(flag, dest=key, type=tp, default=None, help=f"{help_} [{key}]")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any job config field, e.g. --set optim.momentum=0.8")
    p.add_argument("--strategies", type=_csv(str), help="e.g. single,dp,ddp,fsdp,tensor,pipeline")
    p.add_argument("--world-sizes", type=_csv(int), help="e.g. 1,2,4")
    p.add_argument("--mesh", dest="meshes", action="append", default=None, metavar="SIZES",
                   help="a composed layout to compare beside the strategies, e.g. pp=2,dp_shard=2 (repeatable; "
                        "pp, dp_replicate, dp_shard, tp; at each world size it makes)")
    p.add_argument("--precisions", type=_csv(str), help="e.g. 32,fp16-mixed,bf16-mixed")
    p.add_argument("--comm-hooks", type=_csv(str), help="ddp hooks, e.g. none,fp16,bf16,powersgd")
    p.add_argument("--micro-batches", type=int,
                   help="chunks per batch of the pipelined cells of devices (1: sequential only; default 4)")
    p.add_argument("--epochs", type=int, help="epochs per cell")
    p.add_argument("--warmup-steps", type=int, help="untimed first steps per cell")
    p.add_argument("--tolerance", type=float, help="accuracy tolerance of the recommendation (0.02 = 2 points)")
    p.add_argument("--threads", type=int, help="torch threads per process on CPU (default 1)")
    p.add_argument("--cell-timeout", type=float, help="seconds before a cell's processes are killed")
    p.add_argument("--no-baseline", action="store_true", help="leave out the hand-written DDP loop")
    p.add_argument("--no-trap", action="store_true", help="leave out the effective-batch trap cells")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--predict", action="store_true",
                   help="also predict samples/s and scaling efficiency at 2-1024 workers for ddp, fsdp, fp16 and "
                        "PowerSGD compression (compute measured here + communication over the link)")
    p.add_argument("--link", metavar="BW,LAT", type=_link("--link"),
                   help="the network link to predict for (each node's, with --workers-per-node), e.g. 100gbit,5us "
                        "(default: fitted to gloo all-reduces between 2 local processes)")
    p.add_argument("--workers-per-node", type=int, default=1, metavar="G",
                   help="workers (GPUs) per node for --predict: collectives run in two levels, inside a node over "
                        "--node-link and across nodes over --link (default 1: every hop crosses --link)")
    p.add_argument("--node-link", metavar="BW,LAT", type=_link("--node-link"),
                   help="the link between the workers of one node, e.g. 300GB/s,2us (NVLink) or 25GB/s,5us (PCIe)")
    p.add_argument("--exposed", type=float, metavar="F", help="fraction of communication not hidden behind the "
                                                            "backward, 0-1 (default: measured from the ddp 2-worker cell)")
    p.set_defaults(func=main)
    return p


def base_config(args: argparse.Namespace) -> TrainConfig:
    """The job's config (file, then flags, then --set), validated: a one-line error before any process starts."""
    flags = {key: getattr(args, key) for key, *_ in _JOB_FLAGS.values() if getattr(args, key) is not None}
    return TrainConfig.load(args.config, {**flags, **parse_set(args.overrides)})


def check_model(cfg: TrainConfig, multi_process: bool) -> None:
    """Build the job's model once here: a mistake in the user's own model or data is one line
    before any launch; unsynced BatchNorm in multi-process cells is noted."""
    from ..nn.syncbn import has_unsynced_batchnorm

    model = cfg.build_model()
    if multi_process and not cfg.parallel.sync_batchnorm and has_unsynced_batchnorm(model):
        print("paratrain bench: note: the model has BatchNorm layers and --sync-bn is off, so multi-process cells "
              "normalise each worker's micro-batch and may train differently from single (paratrain verify shows "
              "it)", file=sys.stderr, flush=True)


def build_spec(args: argparse.Namespace) -> Any:
    from ..bench.matrix import full_spec, quick_spec

    spec = quick_spec() if args.quick else full_spec()
    changes = {"strategies": args.strategies, "world_sizes": args.world_sizes, "precisions": args.precisions,
               "comm_hooks": args.comm_hooks, "micro_batches": args.micro_batches, "epochs": args.epochs, "warmup_steps": args.warmup_steps,
               "tolerance": args.tolerance, "threads": args.threads, "cell_timeout": args.cell_timeout,
               "meshes": args.meshes}
    changes = {k: v for k, v in changes.items() if v is not None}
    if args.no_baseline:
        changes["baseline"] = False
    if args.no_trap:
        changes["trap"] = False
    return dataclasses.replace(spec, **changes)  # __post_init__ checks every name and value


def check_nodes(args: argparse.Namespace) -> None:
    """--workers-per-node and --node-link go together, with --predict: a one-line error before any cell runs."""
    if args.workers_per_node < 1:
        raise ValueError(f"--workers-per-node {args.workers_per_node} must be at least 1")
    if (args.workers_per_node > 1 or args.node_link) and not args.predict:
        raise ValueError("--workers-per-node and --node-link shape the prediction: add --predict")
    if args.workers_per_node > 1 and not args.node_link:
        raise ValueError(f"--workers-per-node {args.workers_per_node} needs --node-link, the link inside a node: "
                         "e.g. 300GB/s,2us (NVLink) or 25GB/s,5us (PCIe)")
    if args.node_link and args.workers_per_node == 1:
        raise ValueError(f"--node-link {args.node_link} needs --workers-per-node above 1: how many workers share a node")


def main(args: argparse.Namespace) -> int:
    from ..bench import format_table, run_bench, write_all

    check_nodes(args)
    base = base_config(args)
    spec = build_spec(args)
    check_model(base, any(w > 1 for w in spec.world_sizes))
    result = run_bench(spec, base, progress=not args.no_progress)
    print(format_table(result))
    paths = write_all(result, args.out)
    print("wrote " + ", ".join(paths.values()) + ("" if "chart" in paths else " (no chart: pip install matplotlib)"))
    if args.predict:
        from ..bench.scaling import predict_from_bench

        print(predict_from_bench(result, base, args.link, args.exposed, args.out, args.workers_per_node,
                                 args.node_link))
    sys.stdout.flush()
    return 0 if any(r.status == "ok" for r in result.results) else 1
