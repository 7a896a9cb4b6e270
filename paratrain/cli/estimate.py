"""``paratrain estimate``: will the model fit? Each rank's peak memory for each strategy, precision
and world size, before any cluster is rented.

The model is built on the meta device (no memory, any size) and one forward measures what autograd
saves per sample; the formulas are in :mod:`paratrain.bench.memory` (model states as DeepSpeed's ZeRO
paper counts them, DDP's gradient buckets, FSDP's blocks in flight, tensor parallelism's split
Linears, activation checkpointing, CPU offload, Adam's temporaries). ``--model`` takes a built-in
name or your own ``module:function`` / ``file.py:function`` called as ``function(input_shape=...,
num_classes=...)``; ``--tokens VOCAB,LENGTH`` feeds it token ids instead of the dataset's inputs.
``--mesh pp=2,dp_shard=-1,tp=2`` (repeatable) estimates a composed layout at each world size it fits
(the sizes as ``train --mesh`` takes them: -1 is the rest; without ``--world-sizes``, the product of
the sizes), instead of the strategies unless ``--strategies`` is given too.

``--world N --device-memory 80GiB [--nodes K]`` chooses the layout: every mesh of ``N`` workers
(``tp`` within a node) with each rank's peak and a predicted step time
(:mod:`paratrain.bench.layouts`), the ones that fit first, highest predicted throughput first.
"""

from __future__ import annotations

import argparse
from typing import Any

from .bench import _csv, _link  # the same comma-separated lists and links as bench's flags


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from ..bench.memory import OPTIMIZER_STATE_BYTES

    p = subparsers.add_parser("estimate", help="each rank's peak memory per strategy, precision and world size",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp", help="built-in name or your own module:function (default mlp)")
    p.add_argument("--dataset", default="digits", help="whose input shape and classes the model is built for")
    p.add_argument("--tokens", type=_csv(int), default=None, metavar="VOCAB,LENGTH",
                   help="feed token ids of this vocabulary and length (a language model)")
    p.add_argument("--micro-batch", type=int, default=32, help="samples per rank per forward (default 32)")
    p.add_argument("--strategies", type=_csv(str), default=None,
                   help="comma-separated (default: every strategy that runs on several processes, and the reference)")
    p.add_argument("--world-sizes", type=_csv(int), default=None,
                   help="comma-separated (default 1,2,8; with --mesh, the product of its sizes)")
    p.add_argument("--mesh", action="append", default=[], metavar="DIM=N,...",
                   help="a composed layout, e.g. pp=2,dp_shard=2,tp=2 (pp, dp_replicate, dp_shard, tp; one may be -1: "
                        "the rest); repeat it for several")
    p.add_argument("--precisions", type=_csv(str), default=["32"], help="comma-separated (default 32)")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATE_BYTES), help="default adamw")
    p.add_argument("--checkpointing", action="store_true", help="also with activation checkpointing of the blocks")
    p.add_argument("--offload", action="store_true", help="also fsdp with CPU offload")
    p.add_argument("--sharded-init", action="store_true",
                   help="the model is built sharded (pt.init_module), not whole on every rank first")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="where it trains: Adam's temporaries differ (default cuda)")
    p.add_argument("--memory", type=float, default=None, metavar="GIB", help="each rank's memory: mark what fits")
    g = p.add_argument_group("choosing the layout (--world)")
    g.add_argument("--world", type=int, default=None, metavar="N",
                   help="list every layout of N workers: memory per rank and predicted step, what fits first")
    g.add_argument("--nodes", type=int, default=1, metavar="K", help="the workers' nodes (tp stays within one; default 1)")
    g.add_argument("--device-memory", default=None, metavar="SIZE", help="each device's memory, e.g. 80GiB")
    g.add_argument("--device-tflops", type=float, default=100.0,
                   help="what one device achieves in the step, TFLOP/s (default 100: an H100 at ~40%% of bf16 peak)")
    g.add_argument("--link", default=None, type=_link("--link"), metavar="BW,LAT", help="between nodes (default 100gbit,5us)")
    g.add_argument("--node-link", default=None, type=_link("--node-link"), metavar="BW,LAT", help="inside a node (default 300GB/s,2us: NVLink)")
    g.add_argument("--n-microbatches", type=int, default=4, help="a pipeline's micro-batches per step (default 4)")
    p.add_argument("--schedule", default="gpipe",
                   help="a pipeline's schedule (parallel.pipeline.schedule): where a rank's stages sit (default gpipe)")
    p.add_argument("--stages-per-rank", type=int, default=0,
                   help="stages each pipeline rank holds (parallel.pipeline.stages_per_rank; 0: the schedule's default)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from ..bench.memory import estimate, format_estimates, memory_layout
    from ..precision import resolve
    from ..strategies import resolve as resolve_strategy

    from ..strategies import STRATEGIES, reference
    from ..strategies.mesh import MeshOptions, describe

    if args.world is not None:
        return choose(args)
    meshes = [MeshOptions.parse(text) for text in args.mesh]
    if args.world_sizes is None:
        args.world_sizes = sorted({m.smallest_world() for m in meshes}) if meshes else [1, 2, 8]
    if args.strategies is None:  # the reference, and every strategy that spreads one model over processes
        args.strategies = [] if meshes else [reference()] + [n for n, c in STRATEGIES.items() if c.processes != "one"]
    for s in args.strategies:
        resolve_strategy(s)
    layouts: list[tuple[int, dict[str, int]]] = []  # (world, sizes) of each mesh at each world size it fits
    for m in meshes:
        at: list[tuple[int, dict[str, int]]] = []
        for world in args.world_sizes:
            try:
                at.append((world, m.sizes(world)))
            except ValueError:
                continue
        if not at:
            raise ValueError(f"--mesh {m} fits none of the world sizes {','.join(map(str, args.world_sizes))}: "
                             "give --world-sizes its product, or a size of -1")
        layouts += at
    precisions = [resolve(p) for p in args.precisions]
    if args.micro_batch < 1 or any(w < 1 for w in args.world_sizes):
        raise ValueError(f"--micro-batch {args.micro_batch} and --world-sizes {args.world_sizes} must be at least 1")
    depths = [2] + [w for w in args.world_sizes if w > 2] + [sizes["pp"] for _, sizes in layouts if sizes["pp"] > 1]
    facts = _facts(args, depths)
    rows = []
    for precision in precisions:
        for world, sizes in layouts:
            for ckpt in sorted({False, args.checkpointing}):
                rows.append(estimate(facts, describe(sizes), world, args.micro_batch, precision, args.optimizer, ckpt,
                                     sharded_init=args.sharded_init, device=args.device, mesh=sizes))
            if args.offload and sizes["dp_shard"] > 1:
                rows.append(estimate(facts, describe(sizes), world, args.micro_batch, precision, args.optimizer,
                                     args.checkpointing, offload=True, sharded_init=args.sharded_init,
                                     device=args.device, mesh=sizes))
        for strategy in args.strategies:
            for world in args.world_sizes:
                if resolve_strategy(strategy).processes == "one" and world > 1:
                    continue
                for ckpt in sorted({False, args.checkpointing}):
                    rows.append(estimate(facts, strategy, world, args.micro_batch, precision, args.optimizer, ckpt,
                                         sharded_init=args.sharded_init, device=args.device))
                if args.offload and memory_layout(strategy, world) == "sharded":
                    rows.append(estimate(facts, strategy, world, args.micro_batch, precision, args.optimizer,
                                         args.checkpointing, offload=True, sharded_init=args.sharded_init,
                                         device=args.device))
    title = (f"paratrain estimate: {args.model}, micro-batch {args.micro_batch} per rank, {args.optimizer}, "
             f"on {args.device}")
    print(format_estimates(facts, rows, title))
    if args.memory is not None:
        limit = args.memory * 2**30
        fits = list(dict.fromkeys(f"{e.strategy} x{e.world_size} {e.precision}"
                                  + "".join(f" +{o}" for o, on in (("checkpointing", e.checkpointing),
                                                                    ("offload", e.offload)) if on)
                                  for e in rows if e.peak <= limit))
        print(f"fits in {args.memory:g} GiB per rank: {', '.join(fits) if fits else 'none of these'}")
    return 0


def _facts(args: argparse.Namespace, stages: list[int]) -> Any:
    """The model's facts, measured on the meta device for pipelines of ``stages`` depths."""
    import torch

    from ..bench.memory import measure_model
    from ..data.datasets import dataset_info
    from ..models import build_model

    info = dataset_info(args.dataset)
    shape, classes = tuple(info["input_shape"]), info["num_classes"]
    if args.tokens is not None and len(args.tokens) != 2:
        raise ValueError(f"--tokens {args.tokens} must be VOCAB,LENGTH")

    def sample(k: int) -> Any:
        if args.tokens:
            return torch.randint(0, args.tokens[0], (k, args.tokens[1]))
        return torch.randn(k, *shape)

    def loss(out: Any, k: int) -> torch.Tensor:
        logits = out if isinstance(out, torch.Tensor) else out.logits
        flat = logits.reshape(-1, logits.size(-1))
        return torch.nn.functional.cross_entropy(flat, torch.zeros(flat.size(0), dtype=torch.long))

    from ..strategies.pipeline import PipelineOptions

    pipe = PipelineOptions(schedule=args.schedule, stages_per_rank=args.stages_per_rank)  # its one-line errors
    return measure_model(lambda: build_model(args.model, shape, classes), sample, loss, stages=stages,
                         schedule=pipe.schedule, stages_per_rank=pipe.stages_per_rank)


def choose(args: argparse.Namespace) -> int:
    """``--world N``: every layout of N workers, what fits first, highest predicted throughput first."""
    from ..bench.layouts import choose_layouts, format_choices
    from ..bench.predict import Link
    from ..checkpoint.export import parse_size
    from ..precision import resolve

    if args.device_memory is None:
        raise ValueError("--world needs --device-memory, each device's memory (e.g. 80GiB), to say which layouts fit")
    if args.mesh or args.strategies or args.world_sizes:
        raise ValueError("--world lists every layout itself: leave out --mesh, --strategies and --world-sizes")
    memory = parse_size(args.device_memory)
    link = Link.parse(args.link, "--link") if args.link else None
    node_link = Link.parse(args.node_link, "--node-link") if args.node_link else None
    depths = [d for d in range(2, args.world + 1) if args.world % d == 0] or [2]
    facts = _facts(args, depths)
    precision = resolve(args.precisions[0])
    choices = choose_layouts(facts, args.world, args.nodes, args.micro_batch, memory, precision, args.optimizer,
                             args.n_microbatches, args.device_tflops, link, node_link, args.device,
                             sharded_init=True, checkpointing=args.checkpointing)
    title = (f"paratrain estimate: the layouts of {args.world} workers on {args.nodes} node(s) for {args.model}, "
             f"{args.micro_batch} samples per data-parallel rank and step, {precision}, {args.optimizer}, "
             f"{args.device_memory} per device, {args.device_tflops:g} TFLOP/s per device; built sharded "
             f"(pt.init_module); communication not overlapped (an upper bound)")
    print(format_choices(choices, title, args.micro_batch))
    return 0
