"""``paratrain`` command line: one module per subcommand, each with ``add_parser`` and ``main``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from ..checkpoint.io import CheckpointError

# subcommand name -> module under paratrain.cli providing add_parser(subparsers) and main(args) -> int
SUBCOMMANDS = {
    "run": "paratrain.cli.run",
    "train": "paratrain.cli.train",
    "bench": "paratrain.cli.bench",
    "verify": "paratrain.cli.verify",
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
    except (UsageError, ValueError, FileNotFoundError, CheckpointError) as e:
        # One clear line, non-zero exit: the bad value is in the message.
        print(f"paratrain {args.command}: error: {e}", file=sys.stderr)
        if "TORCHELASTIC_ERROR_FILE" in os.environ:
            raise  # a torchrun worker: let @record hand the cause to the agent's one-line report
        return 2


def entry_point() -> None:
    """Console script and ``python -m paratrain``: a worker's uncaught exception is recorded for
    torchrun's failure report (``torch.distributed.elastic``'s ``@record``)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())


if __name__ == "__main__":  # pragma: no cover
    entry_point()
