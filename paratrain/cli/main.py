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
        allow_abbrev=False,
        description="Take a PyTorch training job from one device to N workers without changing its result.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    for p in sub.choices.values():
        p.allow_abbrev = False  # "--nproc" is not "--nproc-per-node": no guessing at flag names
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; a subcommand that runs a user's program (``run``) keeps the program's own
    arguments out of argparse's reach, so they reach the program untouched."""
    sub = _subparsers(parser)
    if argv and argv[0] in sub.choices:
        split = sub.choices[argv[0]].get_default("split_program")
        if split is not None:
            head, program_args = split(sub.choices[argv[0]], argv[1:])
            args = parser.parse_args([argv[0], *head])
            args.script_args = program_args
            return args
    return parser.parse_args(argv)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(parser, argv)
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
