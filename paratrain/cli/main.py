"""``paratrain`` command line: one module per subcommand, each with ``add_parser`` and ``main``."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# subcommand name -> module under paratrain.cli providing add_parser(subparsers) and main(args) -> int
SUBCOMMANDS = {
    "run": "paratrain.cli.run",
    "train": "paratrain.cli.train",
}


class UsageError(Exception):
    """A bad value given by the user: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paratrain",
        description="Take a PyTorch training job from one device to N workers without changing its result.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # subcommands that re-launch themselves under torchrun pass it on
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, FileNotFoundError) as e:
        # One clear line, non-zero exit: the bad value is in the message.
        print(f"paratrain {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
