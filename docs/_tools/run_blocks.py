"""Run every code block of the documentation, so the pages cannot drift from the code.

    python docs/_tools/run_blocks.py [--list] [FILE.md ...]     (default: README.md and docs/**/*.md)

Each page runs in a fresh working directory (a temporary folder that links to everything at the top of
the checkout except ``runs/``, so ``examples/...`` and ``scripts/...`` resolve and a run's files never
land in the checkout); two pages run at a time (``--jobs``). A page's blocks run in page order:

* ``python``: executed in one Python process per page (a later block sees an earlier one's names, as
  in a notebook);
* ``bash``: every command (a line, ``\\``-continued lines joined) runs with ``bash -c`` and must exit 0;
* ``text``: program output shown to the reader, not code: not run.

An HTML comment right before a block changes what happens to it (GitHub and the site hide it)::

    <!-- docs: file NAME -->                   write the block to NAME (a script, a config) for later blocks
    <!-- docs: run append="ARGS" — WHY -->     append ARGS to every command (e.g. --print-config: the
                                               command's flags and values are checked, nothing trains)
    <!-- docs: run exit=1 timeout=120 -->      the exit status every command must have; its time limit (s)
    <!-- docs: run only=1 — WHY -->            run the first command only; the others are parsed (as below)
    <!-- docs: parse — WHY -->                 not run: the ``paratrain ...`` part of every command is parsed
                                               by paratrain's own argument parser (bad flags fail)
    <!-- docs: skip — WHY -->                  not run at all (a GPU, a cluster, root); the count is printed

Every command and every page's Python process runs in its own process group with a hard time limit;
the group is killed when the limit passes, and after each command (workers left behind).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from blocks import ROOT, Block, DocError, check_parse, commands, parse_blocks  # the pages' blocks: what they are

SHIMS: list[str] = []  # folders put first on the blocks' PATH (main: the zygote's `paratrain`)
POPEN: type[subprocess.Popen] = subprocess.Popen
"""How a page's Python process (``page_python.py``) starts (main: forked from the zygote, tests/zygote.py)."""
NOT_COPIED = {"runs", "build", "bench_out", ".pytest_cache"}
PYTHON_TIMEOUT = 120
COMMAND_TIMEOUT = 90
ROOM = 1.0
"""Every time limit is multiplied by this (the test suite, which runs the pages beside its other tests: its
machine's room, tests/pace.py)."""


class Stopped(Exception):
    """Another page failed: this one stops at its next block."""


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Page:
    """One page's working directory, environment and Python process."""

    def __init__(self, path: Path, log):
        self.path = path
        self.log = log
        self.dir = Path(tempfile.mkdtemp(prefix="paratrain-docs-"))
        for entry in ROOT.iterdir():
            if entry.name not in NOT_COPIED:
                (self.dir / entry.name).symlink_to(entry)
        venv_bin = str(Path(sys.executable).parent)
        self.env = dict(os.environ)
        self.env.update(
            PATH=os.pathsep.join([*SHIMS, venv_bin, os.environ.get("PATH", "")]),
            WANDB_MODE="offline", WANDB_SILENT="true", MPLBACKEND="Agg", TQDM_DISABLE="1",
            PYTHONUNBUFFERED="1",
        )
        self.python: subprocess.Popen | None = None
        self.result_fd = -1

    def close(self) -> None:
        if self.python is not None:
            kill_group(self.python.pid)
            self.python.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _start_python(self) -> None:
        r, w = os.pipe()
        self.python = POPEN(
            [sys.executable, str(Path(__file__).with_name("page_python.py")), str(w)], cwd=self.dir, env=self.env,
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            pass_fds=[w],
        )
        os.close(w)
        self.result_fd = r

    def run_python(self, block: Block) -> None:
        if self.python is None:
            self._start_python()
        assert self.python is not None and self.python.stdin is not None
        timeout = float(block.options.get("timeout", PYTHON_TIMEOUT)) * ROOM
        self.python.stdin.write(json.dumps({"code": block.code, "file": str(block.path), "line": block.line}) + "\n")
        self.python.stdin.flush()
        ready, _, _ = select.select([self.result_fd], [], [], timeout)
        if not ready:
            kill_group(self.python.pid)
            self.python.wait()
            self.python = None
            raise DocError(f"ran past its {timeout:.0f} s limit; its process group was killed")
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(self.result_fd, 65536)
            if not chunk:
                raise DocError("the page's Python process died (see the output above)")
            line += chunk
        res = json.loads(line)
        if not res["ok"]:
            raise DocError("raised:\n" + res["error"])

    def run_command(self, command: str, expect: int, timeout: float) -> None:
        self.log.write(f"$ {command}\n")
        self.log.flush()
        proc = subprocess.Popen(["bash", "-c", command], cwd=self.dir, env=self.env, stdin=subprocess.DEVNULL,
                                stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DocError(f"`{command}` ran past its {timeout:.0f} s limit; its process group was killed") from None
        finally:
            kill_group(proc.pid)  # also what a finished command left behind (a launcher's workers)
            proc.wait()
        if code != expect:
            raise DocError(f"`{command}` exited with {code} (expected {expect})")

    def write_file(self, block: Block) -> None:
        name = block.options["name"]
        target = self.dir / name
        if target.is_symlink() or (target.exists() and not target.is_file()):
            raise DocError(f"'docs: file {name}' would overwrite a file of the checkout")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code)
        if block.language == "toml":
            try:
                tomllib.loads(block.code)
            except tomllib.TOMLDecodeError as e:
                raise DocError(f"{name} is not valid TOML: {e}") from None
        elif block.language == "python":
            try:
                compile("\n" * (block.line - 1) + block.code, str(block.path), "exec")
            except SyntaxError as e:
                raise DocError(f"{name} is not valid Python: {e}") from None


@dataclass
class Tally:
    python: int = 0
    commands: int = 0
    files: int = 0
    parsed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    appended: list[str] = field(default_factory=list)
    output: int = 0


def run_page(path: Path, tally: Tally, list_only: bool, verbose: bool = False,
             stop: threading.Event | None = None) -> float:
    blocks = parse_blocks(path)
    start = time.monotonic()
    logf = tempfile.NamedTemporaryFile("w+", prefix="paratrain-docs-", suffix=".log", delete=False)
    page = None if list_only else Page(path, logf)
    try:
        for block in blocks:
            if stop is not None and stop.is_set():
                raise Stopped
            began = time.monotonic()
            try:
                if block.mode == "output":
                    tally.output += 1
                elif block.mode == "skip":
                    tally.skipped.append(f"{block.where} ({block.language}): {block.reason}")
                elif block.mode == "parse":
                    if block.language != "bash":
                        raise DocError("'docs: parse' is for shell blocks")
                    checked = [check_parse(c) for c in commands(block.code)]
                    n = sum(1 for c in checked if c)
                    tally.parsed.append(f"{block.where}: {n} of {len(checked)} commands parsed by paratrain's "
                                        f"parser, none run: {block.reason}")
                elif block.mode == "file":
                    tally.files += 1
                    if page:
                        page.write_file(block)
                elif block.language == "python":
                    tally.python += 1
                    if page:
                        page.run_python(block)
                elif block.language == "bash":
                    append = block.options.get("append", "")
                    if append:
                        tally.appended.append(f"{block.where}: run with {append} appended: {block.reason}")
                    only = int(block.options.get("only", 10**9))  # the first `only` commands run, the rest are parsed
                    if block.options.get("only") and not block.reason:
                        raise DocError("'docs: run only=N' needs a reason after '—' (why the others cannot run)")
                    for index, command in enumerate(commands(block.code)):
                        check_parse(command)
                        if index >= only:
                            tally.parsed.append(f"{block.where}: `{command.split(' #')[0].strip()}` parsed, not run: "
                                                f"{block.reason}")
                            continue
                        tally.commands += 1
                        if page:
                            if append:
                                body, hash_, comment = command.partition(" #")
                                command = f"{body.rstrip()} {append}" + (f"  #{comment}" if hash_ else "")
                            page.run_command(command, int(block.options.get("exit", 0)),
                                             float(block.options.get("timeout", COMMAND_TIMEOUT)) * ROOM)
                else:
                    raise DocError(f"a {block.language} block cannot run: write it to a file or skip it")
                if verbose and page and block.mode in ("run", "file"):
                    print(f"docs:   {block.where} ({block.language}): {time.monotonic() - began:.1f} s", flush=True)
            except DocError as e:
                logf.flush()
                logf.seek(0)
                tail = logf.read()[-6000:]
                raise DocError(f"{block.where}: {e}\n--- output of {path.relative_to(ROOT)} so far ---\n{tail}") \
                    from None
    finally:
        if page:
            page.close()
        logf.close()
        os.unlink(logf.name)
    return time.monotonic() - start


def default_files() -> list[Path]:
    """The Markdown files whose blocks CI runs: the README and the site's pages (not ``docs/_*``)."""
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md")
                                         if not any(part.startswith("_") for part in p.relative_to(ROOT / "docs").parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md and docs/**/*.md)")
    ap.add_argument("--list", action="store_true", help="check the markers and count the blocks; run nothing")
    ap.add_argument("--verbose", action="store_true", help="print each block's time")
    ap.add_argument("--jobs", type=int, default=2, help="pages run at the same time (default 2)")
    ap.add_argument("--max-skipped", type=int, default=10,
                    help="fail when more blocks than this are skipped or only parsed (default 10)")
    args = ap.parse_args(argv)
    files = [p.resolve() for p in args.files] or default_files()
    tallies: dict[Path, Tally] = {}
    failures: list[str] = []
    stop = threading.Event()
    total = time.monotonic()

    def one(path: Path) -> None:
        tally = Tally()
        try:
            seconds = run_page(path, tally, args.list, args.verbose, stop)
        except Stopped:
            return
        except DocError as e:
            stop.set()  # the other pages stop at their next block
            failures.append(str(e))
            return
        tallies[path] = tally
        if not args.list:
            print(f"docs: {path.relative_to(ROOT)}: ok in {seconds:.1f} s", flush=True)

    sys.path.insert(0, str(ROOT / "tests"))
    import zygote

    if not args.list and zygote.enabled():
        # the blocks' `paratrain` commands fork from one process that imported torch (tests/zygote.py):
        # about 2 s of CPU less for each; PARATRAIN_TEST_ZYGOTE=0 starts a new interpreter for each
        os.environ["PARATRAIN_ZYGOTE"] = zygote.start_server(dict(os.environ, MPLBACKEND="Agg", TQDM_DISABLE="1"))
        SHIMS.append(os.path.dirname(zygote.shim()))
        global POPEN
        POPEN = zygote.ZygotePopen
    # the pages with the most to run first, so that the last one to finish is a short one
    order = sorted(files, key=lambda p: -sum(b.mode == "run" for b in parse_blocks(p)))
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, order))
    if failures:
        print(f"docs: FAILED: {failures[0]}", file=sys.stderr)
        return 1
    tally = Tally()
    for path in files:
        page = tallies[path]
        tally.python += page.python
        tally.commands += page.commands
        tally.files += page.files
        tally.output += page.output
        tally.parsed += page.parsed
        tally.skipped += page.skipped
        tally.appended += page.appended
    print(f"docs: {tally.python} python blocks and {tally.commands} shell commands run, {tally.files} blocks "
          f"written to files and used, {tally.output} output blocks (not code); "
          f"{len(tally.parsed)} shell blocks or commands only parsed, {len(tally.skipped)} blocks skipped"
          + ("" if args.list else f"; {time.monotonic() - total:.0f} s"))
    for line in tally.appended:
        print(f"  changed: {line}")
    for line in tally.parsed + tally.skipped:
        print(f"  not run: {line}")
    if len(tally.parsed) + len(tally.skipped) > args.max_skipped:
        print(f"docs: FAILED: {len(tally.parsed) + len(tally.skipped)} blocks do not run (at most "
              f"{args.max_skipped}): make them run here, at tiny sizes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
