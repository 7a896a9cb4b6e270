"""``paratrain verify``: train the same job for K steps at world size 1 and at N (and with gradient
accumulation, and optionally in another precision), compare the final weights and loss curves, and
print the largest relative divergence per tensor with PASS/FAIL against a tolerance. It names the
classic mistakes: BatchNorm not synced across ranks, effective batch changed with the world size,
data order not seeded or different across world sizes, parameters unused in backward, and a
learning rate not scaled when the batch was.

The job is a built-in task configured exactly like ``paratrain train`` (``--config``, flags,
``--set``), or your own training function with ``--entry module:function`` (or
``path/to/script.py:function``). The function is called as ``function(steps)`` in every process,
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set as torchrun sets them; it trains ``steps``
optimizer steps and returns the trained model, its ``state_dict()``, or ``(model, losses)``.
``--strategy`` (the run at N), ``--also-precision`` and ``--check-accumulation`` reach a function
that builds ``paratrain.Parallel`` as defaults of ``Parallel()``; a run whose Parallel did not take
them fails, naming why. Exit code 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
from typing import Any

from . import train as _train


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("verify", help="check that N workers train the same model as one",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", "--nproc_per_node", "--nproc", dest="nproc", type=int, default=2, metavar="N",
                   help="world size compared with 1 (default 2)")
    p.add_argument("--steps", type=int, default=20, metavar="K", help="optimizer steps per run (default 20)")
    p.add_argument("--tol", type=float, default=1e-5, help="relative divergence that passes (default 1e-5)")
    p.add_argument("--check-accumulation", type=int, default=None, metavar="A",
                   help="also run world size 1 with A accumulation steps (default 2, with --entry 0: your function "
                        "gets A as the default of Parallel(accumulation=...); 0 to skip)")
    p.add_argument("--also-precision", default=None, metavar="P",
                   help="also run world size 1 in precision P (e.g. bf16-mixed), against --precision-tol (with "
                        "--entry: the default of your Parallel(precision=...))")
    p.add_argument("--precision-tol", type=float, default=5e-2, help="tolerance of the precision run (default 5e-2)")
    p.add_argument("--entry", default=None, metavar="MODULE:FUNCTION",
                   help="verify your own train(steps) function instead of a built-in config")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it is killed (default 300)")
    p.add_argument("--config", metavar="FILE", help="TOML or YAML config file (as for paratrain train)")
    for flag, (key, tp, help_) in _train._FLAGS.items():
        p.add_argument(flag, dest=key, type=tp, default=None, help=f"{help_} [{key}]")
    p.add_argument("--sync-bn", dest="parallel.sync_batchnorm", action="store_const", const=True, default=None,
                   help="synchronise BatchNorm statistics across workers")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set parallel.ddp.bucket_cap_mb=50")
    p.set_defaults(func=main, progress=None, resume=None)
    return p


_ENTRY_FLAGS = ("--strategy",)
"""Job options that reach a user's function too, as defaults of its ``Parallel()`` (with
``--also-precision`` and ``--check-accumulation``)."""


def _job_options_given(args: argparse.Namespace) -> list[str]:
    """The options given that configure a built-in job only (meaningless with --entry)."""
    given = [flag for flag, (key, *_) in _train._FLAGS.items()
             if getattr(args, key, None) is not None and flag not in _ENTRY_FLAGS]
    given += [flag for flag, value in (("--config", args.config), ("--set", args.overrides),
                                       ("--sync-bn", getattr(args, "parallel.sync_batchnorm"))) if value]
    return given


def main(args: argparse.Namespace) -> int:
    from ..verify import VerifyOptions, format_report, verify_config, verify_entry

    opts = VerifyOptions(world_size=args.nproc, steps=args.steps, tolerance=args.tol,
                         accumulation=args.check_accumulation, precision=args.also_precision,
                         precision_tolerance=args.precision_tol, timeout=args.timeout,
                         strategy=getattr(args, "parallel.strategy") if args.entry else None)
    if args.entry:
        ignored = _job_options_given(args)
        if ignored:
            raise ValueError(f"--entry runs your own train(steps), which builds its own model, data and loop: "
                             f"{', '.join(ignored)} would be ignored; drop {'it' if len(ignored) == 1 else 'them'}")
        report = verify_entry(args.entry, opts)
    else:
        report = verify_config(_train.build_config(args), opts)
    print(format_report(report), flush=True)
    return 0 if report.passed else 1
