"""``paratrain selftest``: prove that this machine trains correctly, and measure how fast.

Within ``--budget`` seconds (default 300) it runs, on the hardware it finds: a short fixed-seed run
of every strategy and precision the hardware supports, each compared with a one-process reference
(a divergence fails the command, exit code 1); all_reduce/all_gather latency and bus bandwidth as
nccl-tests computes them; paratrain's ddp step against the hand-written DDP loop (and Accelerate's
and Lightning Fabric's, where they are installed), interleaved in the same processes; each
strategy's peak memory; single vs DataParallel vs DDP vs mixed precision on ResNet-50 (synthetic
CIFAR-shaped data); the device facts (bf16, TF32, fp16, compute capability, NCCL, P2P/NVLink,
torch.compile). It prints one table and writes selftest.json and selftest.md into --out. What did
not fit the budget or this hardware is listed with the reason.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _nproc(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes or 'auto'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} processes: use at least 1, or 'auto'")
    return n


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from ..selftest.run import SECTIONS

    p = subparsers.add_parser("selftest", help="check that this machine trains correctly, and how fast",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=300.0, metavar="SECONDS",
                   help="wall time for the whole run (default 300); what does not fit is skipped and listed")
    p.add_argument("--nproc-per-node", dest="nproc", type=_nproc, default=None, metavar="N|auto",
                   help="processes of the multi-process checks (auto: every GPU when there are 2 or more, else 2)")
    p.add_argument("--out", default="runs/selftest", metavar="DIR", help="where selftest.json and selftest.md go")
    p.add_argument("--sections", type=_csv, default=None, metavar="LIST",
                   help=f"run only these, comma-separated: {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--strategies", type=_csv, default=None, metavar="LIST",
                   help="strategies of the correctness and memory checks (default: all)")
    p.add_argument("--precisions", type=_csv, default=None, metavar="LIST",
                   help="precisions of the correctness checks (default: 32,bf16-mixed,fp16-mixed)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from ..selftest import SelftestOptions, run_selftest

    given = {k: v for k, v in (("sections", args.sections), ("strategies", args.strategies),
                               ("precisions", args.precisions)) if v is not None}
    opts = SelftestOptions(budget=args.budget, nproc=args.nproc, **given)

    def progress(line: str) -> None:
        print(f"selftest: {line}", file=sys.stderr, flush=True)

    report = run_selftest(opts, None if args.no_progress else progress)
    print(report.table())
    paths = report.write(args.out)
    print(f"wrote {paths['json']} and {paths['md']}")
    return 1 if report.failed else 0
