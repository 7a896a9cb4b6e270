"""Tokens/s read from a memory-mapped token file: paratrain's train loader against nanoGPT's ``get_batch``
and a bare memmap read of the same windows.

What it measures
    A token file of ``--tokens`` (50 million) random ``uint16`` ids (nanoGPT's ``train.bin``
    format), in the OS page cache (read once before timing), read as windows of ``--block`` (1024)
    tokens and their next-token targets, ``--batch`` (12) windows a step (nanoGPT's defaults), as
    int64 tensors on the CPU, nothing else done with them:

    * ``floor``: the windows paratrain reads (its random offsets, drawn from (seed, epoch, index)),
      precomputed, each step one int64 buffer and one slice copy a window from a memmap opened
      once: the fastest read of these windows found, the floor of any loader that hands out fresh
      int64 tensors of them;
    * ``bare``: the same windows read as nanoGPT reads a window (a slice of the memmap, ``astype``,
      ``torch.from_numpy``, x and y each stacked), the memmap opened once: a bare memmap read;
    * ``nanogpt``: nanoGPT's ``get_batch`` as ``train.py`` writes it: the memmap opened again every
      step (its guard against a memory leak), ``torch.randint`` offsets, one ``torch.from_numpy``
      per window and ``torch.stack``;
    * ``paratrain``: ``Parallel.train_loader(TokenWindows(path, block, windows="random"))``, world
      size 1, with ``--workers`` 0 and 2 DataLoader workers.

How
    One untimed warm-up, then ``--rounds`` rounds; in each round every variant reads ``--steps``
    steps, the order rotating from round to round, timed with ``time.perf_counter()``. Printed:
    per variant the median and min-max of tokens/s over rounds, and the medians of the per-round
    ratios to ``bare`` (the goal for paratrain: at least 0.9) and to ``floor``.

Usage::

    python benchmarks/tokens.py [--tokens 50000000] [--block 1024] [--batch 12] [--steps 400] [--rounds 5]
    python benchmarks/tokens.py --smoke   # 1M tokens, 20 steps, one round: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import paratrain  # noqa: E402
from paratrain.data import TokenWindows  # noqa: E402


def given_windows(path: str, ds: TokenWindows, batch: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The memmap (opened once) and the first tokens of the windows paratrain reads, step by step."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    perm = paratrain.data.epoch_permutation(len(ds), 0, 0).numpy()
    _, offsets = ds.offsets(perm[:batch * steps], 0)
    return data, offsets.reshape(steps, batch)


def bare(path: str, ds: TokenWindows, batch: int, steps: int) -> Callable[[], int]:
    """nanoGPT's reads of the given windows: a slice of the memmap per window, x and y each stacked."""
    data, offsets = given_windows(path, ds, batch, steps)
    T = ds.block_size

    def run() -> int:
        for ix in offsets.tolist():
            x = torch.stack([torch.from_numpy((data[i:i + T]).astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + T]).astype(np.int64)) for i in ix])
            assert x.shape == y.shape == (batch, T)
        return steps * batch * T
    return run


def floor(path: str, ds: TokenWindows, batch: int, steps: int) -> Callable[[], int]:
    """The fastest read of the given windows found: one int64 buffer a step, one slice copy a window
    (``T + 1`` tokens: x and y are views of it)."""
    data, offsets = given_windows(path, ds, batch, steps)
    data = np.asarray(data)
    n = ds.block_size + 1

    def run() -> int:
        for ix in offsets.tolist():
            out = np.empty((batch, n), dtype=np.int64)
            for r, i in enumerate(ix):
                out[r] = data[i:i + n]
            t = torch.from_numpy(out)
            x, y = t[:, :-1], t[:, 1:]
            assert x.shape == y.shape == (batch, n - 1)
        return steps * batch * (n - 1)
    return run


def nanogpt(path: str, block: int, batch: int, steps: int) -> Callable[[], int]:
    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        # nanoGPT's train.py: "We recreate np.memmap every batch to avoid a memory leak"
        data = np.memmap(path, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block, (batch,))
        x = torch.stack([torch.from_numpy((data[i:i + block]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block]).astype(np.int64)) for i in ix])
        return x, y

    def run() -> int:
        for _ in range(steps):
            x, _ = get_batch()
            assert x.shape == (batch, block)
        return steps * batch * block
    return run


def ours(pt: paratrain.Parallel, ds: TokenWindows, steps: int, workers: int) -> Callable[[], int]:
    kwargs = {"num_workers": workers, "persistent_workers": True} if workers else {}
    loader = pt.train_loader(ds, **kwargs)

    def run() -> int:
        pt.global_step = 0
        n = 0
        for x, _ in loader:
            n += x.numel()
            pt.global_step += 1
            if pt.global_step >= steps:
                break
        return n
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=50_000_000)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.steps, args.rounds = 1_000_000, 20, 1
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.bin")
        np.random.default_rng(0).integers(0, 50257, args.tokens, dtype=np.uint16).tofile(path)
        with open(path, "rb") as f:  # into the page cache
            while f.read(1 << 24):
                pass
        ds = TokenWindows(path, args.block, windows="random")
        pt = paratrain.Parallel(global_batch=args.batch, log_to=[])
        variants = {"floor": floor(path, ds, args.batch, args.steps), "bare": bare(path, ds, args.batch, args.steps),
                    "nanogpt": nanogpt(path, args.block, args.batch, args.steps)}
        for w in workers:
            variants[f"paratrain w{w}"] = ours(pt, ds, args.steps, w)
        for run in variants.values():
            run()  # warm-up: worker start, first pages
        rates: dict[str, list[float]] = {k: [] for k in variants}
        ratios: dict[str, list[float]] = {k: [] for k in variants}
        to_floor: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            got = {}
            for name in order:
                start = time.perf_counter()
                n = variants[name]()
                got[name] = n / (time.perf_counter() - start)
            for name in names:
                rates[name].append(got[name])
                ratios[name].append(got[name] / got["bare"])
                to_floor[name].append(got[name] / got["floor"])
        pt.close()
    print(f"token file of {args.tokens:,} uint16 tokens (page cache), windows of {args.block}, {args.batch} a step, "
          f"{args.steps} steps a round, {args.rounds} round(s); torch {torch.__version__}, {os.cpu_count()} cores")
    print(f"{'variant':<14}{'tokens/s (median)':>20}{'min-max':>26}{'x bare':>9}{'x floor':>9}  (medians of per-round ratios)")
    for name in names:
        rs = rates[name]
        print(f"{name:<14}{statistics.median(rs):>20,.0f}{f'{min(rs):,.0f}-{max(rs):,.0f}':>26}"
              f"{statistics.median(ratios[name]):>9.2f}{statistics.median(to_floor[name]):>9.2f}")


if __name__ == "__main__":
    main()
