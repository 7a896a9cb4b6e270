"""``paratrain estimate``: will the model fit? Each rank's peak memory for each strategy, precision
and world size, before any cluster is rented.

The model is built on the meta device (no memory, any size) and one forward measures what autograd
saves per sample; the formulas are in :mod:`paratrain.bench.memory` (model states as DeepSpeed's ZeRO
paper counts them, DDP's gradient buckets, FSDP's blocks in flight, tensor parallelism's split
Linears, activation checkpointing, CPU offload, Adam's temporaries). ``--model`` takes a built-in
name or your own ``module:function`` / ``file.py:function`` called as ``function(input_shape=...,
num_classes=...)``; ``--tokens VOCAB,LENGTH`` feeds it token ids instead of the dataset's inputs.
"""

from __future__ import annotations

import argparse
from typing import Any

from .bench import _csv  # the same comma-separated lists as bench's flags


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
    p.add_argument("--world-sizes", type=_csv(int), default=[1, 2, 8], help="comma-separated (default 1,2,8)")
    p.add_argument("--precisions", type=_csv(str), default=["32"], help="comma-separated (default 32)")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATE_BYTES), help="default adamw")
    p.add_argument("--checkpointing", action="store_true", help="also with activation checkpointing of the blocks")
    p.add_argument("--offload", action="store_true", help="also fsdp with CPU offload")
    p.add_argument("--sharded-init", action="store_true",
                   help="the model is built sharded (pt.init_module), not whole on every rank first")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="where it trains: Adam's temporaries differ (default cuda)")
    p.add_argument("--memory", type=float, default=None, metavar="GIB", help="each rank's memory: mark what fits")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    import torch

    from ..bench.memory import estimate, format_estimates, measure_model, memory_layout
    from ..data.datasets import dataset_info
    from ..models import build_model
    from ..precision import resolve
    from ..strategies import resolve as resolve_strategy

    from ..strategies import STRATEGIES, reference

    if args.strategies is None:  # the reference, and every strategy that spreads one model over processes
        args.strategies = [reference()] + [n for n, c in STRATEGIES.items() if c.processes != "one"]
    for s in args.strategies:
        resolve_strategy(s)
    precisions = [resolve(p) for p in args.precisions]
    if args.micro_batch < 1 or any(w < 1 for w in args.world_sizes):
        raise ValueError(f"--micro-batch {args.micro_batch} and --world-sizes {args.world_sizes} must be at least 1")
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

    facts = measure_model(lambda: build_model(args.model, shape, classes), sample, loss)
    rows = []
    for precision in precisions:
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
