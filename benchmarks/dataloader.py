"""Samples/s of paratrain's train loader against a plain per-sample ``DataLoader``.

What it measures
    Reading CIFAR-shaped data (``3x32x32`` images and int64 labels in a ``TensorDataset``) in
    shuffled batches of ``--batch`` (256), nothing else done with the batch, for each of
    ``--dtypes``: ``uint8`` images (how CIFAR-10 is stored: torchvision's ``CIFAR10.data``, the
    python batch files; 3 KiB an image) and ``float32`` ones (what paratrain's built-in datasets
    hold; 12 KiB an image, so four times the bytes to copy):

    * ``paratrain``: ``GlobalBatchLoader`` (what ``Parallel.train_loader`` returns for a dataset),
      world size 1; a ``TensorDataset`` is read with one indexing operation per tensor per batch
      (``paratrain.data.loaders.batch_view``);
    * ``per-sample``: ``DataLoader(dataset, batch_size=256, shuffle=True, drop_last=True)``: one
      ``__getitem__`` per sample, then ``default_collate``.

    * the cost of seeding: a dataset with its own ``__getitem__`` (the rows as they are, and with
      torchvision's transforms) read per sample by both, paratrain seeding each sample's random
      draws by ``(seed, epoch, index)`` (``paratrain.data.loaders.SeededSamples``).

    Each with ``--workers`` 0 and 2 (``persistent_workers`` so that only steady-state reading is
    timed). Where torchvision is importable, also per-sample torchvision transforms
    (``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip``, on tensors) against paratrain's
    batched ``BatchAugment`` of the same two operations; otherwise that comparison is skipped with
    the reason printed.

How
    One untimed warm-up epoch per loader, then ``--rounds`` rounds; in each round every variant
    reads one epoch (``--samples`` / batch batches), in ABBA order alternating from round to
    round, timed with ``time.perf_counter()``. Printed: per variant the median and min–max of
    samples/s over rounds, and the median and min–max of the per-round ratio paratrain/other.
    With 0 workers also the rate of a bare ``clone()`` of ``batch`` contiguous images, timed in
    the same rounds: any loader that hands out a fresh batch copies at least that much, so it is
    the ceiling of the ratio on this machine.

Usage::

    python benchmarks/dataloader.py [--rounds 5] [--samples 10240] [--batch 256] [--workers 0,2]
                                    [--dtypes uint8,float32] [--threads N]
    python benchmarks/dataloader.py --smoke   # one round of 256 samples: checks that it runs (CI)

``--threads`` (default: torch's default, the cores here) sets the intra-op threads of both sides:
``index_select`` of a batch spreads over them, the per-sample loader's Python does not.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Iterable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402

from paratrain.data import BatchPlan, GlobalBatchLoader  # noqa: E402
from paratrain.data.augment import BatchAugment  # noqa: E402


def read_epoch(loader: Iterable[Any]) -> int:
    n = 0
    for batch in loader:
        n += len(batch[0])
    return n


class PerSampleTransform(Dataset):
    def __init__(self, data: TensorDataset, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.data, self.transform = data, transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        return self.transform(x), y


def variants(data: TensorDataset, batch: int, workers: int,
             compare: str = "all") -> dict[str, tuple[Iterable[Any], Iterable[Any]]]:
    """name -> (paratrain loader, the loader it is compared with); ``compare="per-sample"``: the first only."""
    kw: dict[str, Any] = {"num_workers": workers, "persistent_workers": workers > 0}
    plan = BatchPlan.derive(batch, 1)
    cpu = torch.device("cpu")
    pairs: dict[str, tuple[Iterable[Any], Iterable[Any]]] = {
        "per-sample DataLoader": (GlobalBatchLoader(data, plan, 0, cpu, **kw),
                                  DataLoader(data, batch_size=batch, shuffle=True, drop_last=True, **kw)),
    }
    if compare == "per-sample":
        return pairs
    # A dataset with its own __getitem__ is read per sample by both; paratrain seeds every sample's
    # random draws (SeededSamples): what that costs.
    own = PerSampleTransform(data, lambda x: x)
    pairs["DataLoader, a per-sample dataset (paratrain: seeded per sample)"] = (
        GlobalBatchLoader(own, plan, 0, cpu, **kw), DataLoader(own, batch_size=batch, shuffle=True, drop_last=True, **kw))
    try:
        from torchvision import transforms  # type: ignore[import-not-found]
    except ImportError as e:
        print(f"  skipped: torchvision per-sample transforms ({e}); pip install torchvision to compare")
        return pairs
    augment = BatchAugment(crop_padding=4, flip=True)
    per_sample = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()])
    pairs["torchvision per-sample transforms"] = (
        GlobalBatchLoader(data, plan, 0, cpu, transform=augment, **kw),
        DataLoader(PerSampleTransform(data, per_sample), batch_size=batch, shuffle=True, drop_last=True, **kw),
    )
    tv = PerSampleTransform(data, per_sample)
    pairs["DataLoader, torchvision per-sample transforms (paratrain: the same, seeded per sample)"] = (
        GlobalBatchLoader(tv, plan, 0, cpu, **kw), DataLoader(tv, batch_size=batch, shuffle=True, drop_last=True, **kw))
    return pairs


def bare_copy_seconds(data: TensorDataset, batch: int, repeats: int = 20) -> float:
    """Seconds to copy ``batch`` contiguous images: memory bandwidth, the floor of reading a batch."""
    x = data.tensors[0]
    t0 = time.perf_counter()
    for i in range(repeats):
        lo = (i * batch) % (len(x) - batch)
        x[lo:lo + batch].clone()
    return (time.perf_counter() - t0) / repeats


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}–{max(values):,.0f})"


SMOKE = {"rounds": 1, "samples": 256, "batch": 64}
"""``--smoke``: what CI runs (``tests/test_benchmarks.py``); flags given explicitly still win."""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=10240)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--dtypes", default="uint8,float32")
    ap.add_argument("--compare", choices=("all", "per-sample"), default="all",
                    help="all pairs, or only paratrain's loader against the per-sample DataLoader (the headline ratio)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="intra-op threads for both sides (default: torch's default here, %(default)s)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"check that the benchmark runs, quickly ({SMOKE}); the numbers mean nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    if args.samples <= args.batch:  # an epoch is one batch at least; bare_copy_seconds needs room to move
        ap.error(f"--samples {args.samples} must be more than --batch {args.batch}")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}; batch {args.batch}, {args.samples} samples an epoch, "
          f"{args.rounds} rounds, {args.threads} intra-op thread(s)")
    for dtype in args.dtypes.split(","):
        g = torch.Generator().manual_seed(0)
        if dtype == "uint8":
            images = torch.randint(0, 256, (args.samples, 3, 32, 32), generator=g, dtype=torch.uint8)
        elif dtype == "float32":
            images = torch.randn(args.samples, 3, 32, 32, generator=g)
        else:
            sys.exit(f"--dtypes {dtype!r}: use uint8 and/or float32")
        data = TensorDataset(images, torch.randint(0, 10, (args.samples,), generator=g))
        for workers in (int(w) for w in args.workers.split(",")):
            print(f"\n{dtype} images, {workers} worker(s):")
            run(data, args, workers)


def run(data: TensorDataset, args: argparse.Namespace, workers: int) -> None:
    """Time each pair of loaders over ``--rounds`` rounds and print their rates and ratios."""
    for name, (ours, theirs) in variants(data, args.batch, workers, args.compare).items():
        read_epoch(ours), read_epoch(theirs)  # warm-up: workers started, caches filled
        rates: dict[str, list[float]] = {"paratrain": [], "other": []}
        for r in range(args.rounds):
            order = [("paratrain", ours), ("other", theirs)]
            order = order + order[::-1] if r % 2 == 0 else order[::-1] + order
            seconds = {"paratrain": 0.0, "other": 0.0}
            samples = {"paratrain": 0, "other": 0}
            for key, loader in order:
                t0 = time.perf_counter()
                samples[key] += read_epoch(loader)
                seconds[key] += time.perf_counter() - t0
            for key in seconds:
                rates[key].append(samples[key] / seconds[key])
            if workers == 0 and name == "per-sample DataLoader":
                copy_s = bare_copy_seconds(data, args.batch)
                rates.setdefault("copy", []).append(args.batch / copy_s)
        ratios = [a / b for a, b in zip(rates["paratrain"], rates["other"])]
        if "copy" in rates:  # the most any loader that copies its batch can read
            ceiling = [c / b for c, b in zip(rates["copy"], rates["other"])]
            print(f"  bare copy of a batch's images (contiguous clone, no gather): {spread(rates['copy'])} "
                  f"samples/s = {statistics.median(ceiling):.1f}× the per-sample DataLoader (the ceiling)")
        print(f"  paratrain train loader: {spread(rates['paratrain'])} samples/s (median, min–max)")
        print(f"  {name}: {spread(rates['other'])} samples/s")
        print(f"  ratio paratrain / {name}: median {statistics.median(ratios):.1f}× "
              f"(per round {min(ratios):.1f}–{max(ratios):.1f}×)")


if __name__ == "__main__":
    main()
