"""``paratrain`` command line: one module per subcommand, each with ``add_parser`` and ``main``."""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import warnings
from typing import Any, NoReturn, Sequence

from ..checkpoint.io import CheckpointError
from ..env.detect import detect_process
from ..env.disk import StorageError
from ..env.process import CollectiveTimeoutError, UnavailableError

# subcommand name -> module under paratrain.cli providing add_parser(subparsers) and main(args) -> int
SUBCOMMANDS = {
    "run": "paratrain.cli.run",
    "train": "paratrain.cli.train",
    "bench": "paratrain.cli.bench",
    "verify": "paratrain.cli.verify",
    "env": "paratrain.cli.env",
    "export": "paratrain.cli.export",
    "selftest": "paratrain.cli.selftest",
    "estimate": "paratrain.cli.estimate",
    "doctor": "paratrain.cli.doctor",
}


class UsageError(Exception):
    """A bad value given by the user: printed as one line, exit code 2."""


# What a user can fix from one line: a bad value, a missing or unusable file, a damaged checkpoint.
# Anything else is a bug and keeps its traceback.
USER_ERRORS = (UsageError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError,
               PermissionError, CheckpointError, UnavailableError, CollectiveTimeoutError, StorageError)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line: the usage is one ``--help`` away."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="paratrain",
        allow_abbrev=False,
        description="Take a PyTorch training job from one device to N workers without changing its result.",
    )
    from .._version import __version__

    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
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


def _warning_line(message: Any, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
    """A warning as one line: paratrain's own say only their message, others where they come from."""
    text = " ".join(str(message).split())
    if os.sep + "paratrain" + os.sep in filename:
        return f"paratrain: warning: {text}\n"
    return f"{os.path.basename(filename)}:{lineno}: {category.__name__}: {text}\n"


def main(argv: Sequence[str] | None = None) -> int:
    warnings.formatwarning = _warning_line  # the command line prints each warning in one line
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(parser, argv)
    args.argv = argv  # subcommands that re-launch themselves under torchrun pass it on
    os.environ["PARATRAIN_COMMAND"] = shlex.join(["paratrain", *argv])  # the workers' provenance (the same argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; 128 + SIGINT as a shell reports it
        print(f"paratrain {args.command}: interrupted (a run continues from its last checkpoint with --resume)",
              file=sys.stderr, flush=True)
        return 130
    except USER_ERRORS as e:
        # One clear line, non-zero exit: the bad value is in the message. The traceback goes to a file.
        where = _save_traceback(args.command)
        line = f"{_one_line(e)}" + (f" (traceback: {where})" if where else "")
        if "TORCHELASTIC_ERROR_FILE" in os.environ:
            # A torchrun worker: the agent prints one line for the whole job from this record.
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            # under the error's own name; not type(e)(line): some (JSONDecodeError) take more arguments
            ErrorHandler().record_exception(type(type(e).__name__, (Exception,), {})(line))
            # Exit now: Python's teardown with torch loaded takes seconds, and until this process is
            # gone the agent cannot stop the others (a hung peer, the rest of the group).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        else:
            print(f"paratrain {args.command}: error: {line}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())  # a KeyError's quotes, a multi-line message: one line
    return text if isinstance(e, (UsageError, ValueError, CheckpointError, UnavailableError, CollectiveTimeoutError,
                                  StorageError)) else f"{type(e).__name__}: {text}"


def _save_traceback(command: str) -> str | None:
    """Write the current exception's traceback to ``$PARATRAIN_ERROR_DIR`` (the run directory,
    set by ``paratrain train``) or the temp folder; its path, or None if nothing could be written."""
    import tempfile
    import traceback

    try:  # RANK alone is torchrun's: under srun or mpirun every rank would write (over) rank 0's file
        rank = detect_process().rank
    except (ValueError, KeyError):  # the launcher's variables are what failed
        rank = 0
    for folder in (os.environ.get("PARATRAIN_ERROR_DIR"), os.path.join(tempfile.gettempdir(), "paratrain-errors")):
        if not folder:
            continue
        try:
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"error-{command}-rank{rank}.log")
            with open(path, "w") as f:
                f.write(traceback.format_exc())
            return path
        except OSError:
            continue
    return None


def entry_point() -> None:
    """Console script and ``python -m paratrain``: a worker's uncaught exception is recorded for
    torchrun's failure report (``torch.distributed.elastic``'s ``@record``)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())


if __name__ == "__main__":  # pragma: no cover
    entry_point()
