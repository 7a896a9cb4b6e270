"""Resume time of a sharded stream at 0%, 10%, 50% and 90% of a pass: flat where the shards can seek.

What it measures
    A generated stream of ``--samples`` (10 million) samples in ``--shards`` (100) shards of unequal
    length (50% to 150% of the mean, a fixed draw), each sample a small dict of tensors built when
    read (as a decoder would), ``ShardedStream`` with its lengths given and 16 virtual readers,
    global batch ``--batch`` (256). For each position (0, 10, 50, 90% of the pass's steps): the
    time from ``Parallel.train_loader`` (its global step set to the position, as a resumed run's
    is) to the first micro-batch in hand, for

    * ``seek``: the stream has ``seek(source, offset)`` (an indexed format: a token file, Parquet
      row groups, an Arrow table): each shard is opened at its position;
    * ``read``: no ``seek``: each open shard is read from its start to its position (never the
      steps before it in other shards);
    * ``plain``: the same samples as one ``IterableDataset`` (no shards): a resumed run reads the
      whole stream up to its position (what paratrain did for every stream before, and what
      torchdata's ``StatefulDataLoader`` and HF ``datasets`` streaming do within a shard).

    ``plain`` is measured up to ``--plain-max`` positions' worth (it grows with the position;
    the larger positions are extrapolated from the measured rate and marked ``~``).

How
    ``--rounds`` rounds, the variants in turn, one process, world size 1; the median and the
    min-max over rounds are printed, and each position's median over the 0% median.

Usage::

    python benchmarks/stream_resume.py [--samples 10000000] [--shards 100] [--batch 256] [--rounds 3]
    python benchmarks/stream_resume.py --smoke   # 200,000 samples, one round: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Iterator

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

import paratrain  # noqa: E402
from paratrain.data import ShardedStream  # noqa: E402


def lengths_for(samples: int, shards: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    weights = 0.5 + torch.rand(shards, generator=g, dtype=torch.float64)
    raw = (weights / weights.sum() * samples).floor().long().tolist()
    raw[-1] += samples - sum(raw)
    return raw


class Shards:
    """Shard ``k`` yields ``lengths[k]`` samples, each decoded (built) when read."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def read(self, k: int) -> Iterator[dict[str, Any]]:
        return self.seek(k, 0)

    def seek(self, k: int, offset: int) -> Iterator[dict[str, Any]]:
        for j in range(offset, self.lengths[k]):
            yield {"id": torch.tensor(k * 10_000_000 + j), "x": torch.full((4,), float(j % 7))}


class Plain(IterableDataset):
    def __init__(self, shards: Shards) -> None:
        self.shards = shards

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for k in range(len(self.shards.lengths)):
            yield from self.shards.read(k)


def time_to_first(pt: paratrain.Parallel, data: Any, step: int) -> float:
    pt.global_step = step
    start = time.perf_counter()
    batch = next(iter(pt.train_loader(data)))
    assert batch["id"].numel() == pt.plan.micro_batch
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plain-max", type=float, default=0.1, help="largest fraction of the pass plain reads for real")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.samples, args.shards, args.rounds = 200_000, 20, 1
    lengths = lengths_for(args.samples, args.shards)
    shards = Shards(lengths)
    steps = args.samples // args.batch
    fractions = (0.0, 0.1, 0.5, 0.9)
    pt = paratrain.Parallel(global_batch=args.batch, log_to=[])
    quiet = open(os.devnull, "w")
    times: dict[tuple[str, float], list[float]] = {}
    plain_rate: list[float] = []
    stdout, sys.stdout = sys.stdout, quiet
    try:  # warm-up: the first loader pays for imports and allocations
        time_to_first(pt, ShardedStream(range(args.shards), shards.read, lengths=lengths, readers=16), 0)
        time_to_first(pt, Plain(shards), 0)
    finally:
        sys.stdout = stdout
    for _ in range(args.rounds):
        for f in fractions:
            step = int(f * steps)
            for name in ("seek", "read"):
                stream = ShardedStream(range(args.shards), shards.read, lengths=lengths, readers=16,
                                       seek=shards.seek if name == "seek" else None)
                stdout, sys.stdout = sys.stdout, quiet  # the loader's resume note
                try:
                    times.setdefault((name, f), []).append(time_to_first(pt, stream, step))
                finally:
                    sys.stdout = stdout
            if f <= args.plain_max:
                stdout, sys.stdout = sys.stdout, quiet
                try:
                    t = time_to_first(pt, Plain(shards), step)
                finally:
                    sys.stdout = stdout
                times.setdefault(("plain", f), []).append(t)
                if step:
                    plain_rate.append(step / t)
    pt.close()
    print(f"stream of {args.samples:,} samples in {args.shards} shards ({min(lengths):,}..{max(lengths):,} each), "
          f"global batch {args.batch}, {steps:,} steps a pass; {args.rounds} round(s); torch {torch.__version__}")
    print("time from train_loader to the first micro-batch of a run resumed at a position (median, min-max):")
    print(f"{'source':<8}" + "".join(f"{f'{int(f * 100)}%':>32}" for f in fractions))
    for name in ("seek", "read", "plain"):
        row = f"{name:<8}"
        base = statistics.median(times[(name, 0.0)])
        for f in fractions:
            got = times.get((name, f))
            if got:
                med = statistics.median(got)
                row += f"{f'{med * 1e3:.1f} ms ({min(got) * 1e3:.0f}-{max(got) * 1e3:.0f}) x{med / base:.1f}':>32}"
            else:
                rate = statistics.median(plain_rate) if plain_rate else float("nan")
                est = base + int(f * steps) / rate
                row += f"{f'~{est:.1f} s x{est / base:.0f}':>32}"
        print(row)
    worst = max(statistics.median(times[("seek", f)]) for f in fractions) / statistics.median(times[("seek", 0.0)])
    print(f"seek: the slowest position takes {worst:.2f}x the time at 0% (the goal: at most 2x)")


if __name__ == "__main__":
    main()
