"""What a documentation page's code blocks are (``run_blocks.py`` runs them): the fenced blocks of
a Markdown file with the ``<!-- docs: ... -->`` marker before each, a shell block's commands, and
the check of a command's ``paratrain`` arguments by paratrain's own parser."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*docs:\s*(?P<body>.*?)\s*-->\s*$")
CODE_LANGUAGES = {"python", "bash", "toml", "yaml"}
OUTPUT_LANGUAGES = {"text"}
NOT_CODE = re.compile(r"^\{.*\}$")  # MyST directives: {toctree}, {eval-rst}, {paratrain-cli}


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the first line of code
    language: str
    code: str
    mode: str = "run"  # run, file, parse, skip, output
    reason: str = ""
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


class DocError(Exception):
    pass


def _marker(text: str, where: str) -> tuple[str, dict[str, str], str]:
    """``mode [key=value ...] [— reason]`` -> (mode, options, reason)."""
    head, _, reason = text.partition("—")
    words = shlex.split(head)
    if not words or words[0] not in ("run", "file", "parse", "skip"):
        raise DocError(f"{where}: unknown docs marker {text!r}: use run, file NAME, parse or skip")
    mode, options = words[0], {}
    for word in words[1:]:
        key, eq, value = word.partition("=")
        if mode == "file" and not eq:
            options["name"] = word
        elif key in ("append", "exit", "timeout", "only") and eq:
            options[key] = value
        else:
            raise DocError(f"{where}: unknown option {word!r} in docs marker {text!r}")
    if mode == "file" and "name" not in options:
        raise DocError(f"{where}: 'docs: file' needs a file name")
    if mode in ("parse", "skip") and not reason.strip():
        raise DocError(f"{where}: 'docs: {mode}' needs a reason after '—' (why it cannot run here)")
    return mode, options, reason.strip()


def parse_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the marker that precedes each."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i, pending = 0, None
    while i < len(lines):
        m = MARKER.match(lines[i])
        if m:
            pending = (m.group("body"), i + 1)
            i += 1
            continue
        f = FENCE.match(lines[i])
        if not f:
            if lines[i].strip():
                pending = None  # a marker applies to the block right after it only
            i += 1
            continue
        fence, indent = f.group("fence"), len(f.group("indent"))
        language = (f.group("info").strip().split() or [""])[0]
        end = i + 1
        while end < len(lines) and not re.match(rf"^ {{0,{indent + 3}}}{fence[0]}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        if end == len(lines):
            raise DocError(f"{path.relative_to(ROOT)}:{i + 1}: code block never closed")
        code = "\n".join(ln[indent:] if not ln[:indent].strip() else ln.lstrip() for ln in lines[i + 1:end])
        block = Block(path, i + 2, language, code + "\n")
        where = block.where
        if pending:
            block.mode, block.options, block.reason = _marker(pending[0], f"{path.relative_to(ROOT)}:{pending[1]}")
        if NOT_CODE.match(language):
            pass  # a directive, not a code block
        elif language in OUTPUT_LANGUAGES and not pending:
            block.mode = "output"
            blocks.append(block)
        elif language not in CODE_LANGUAGES:
            raise DocError(f"{where}: code block in {language or 'no language'!r}: use python, bash, toml, yaml "
                           "or text (output)")
        elif language in ("toml", "yaml") and block.mode not in ("file", "skip"):
            raise DocError(f"{where}: a {language} block must be written to a file for a command to use "
                           "(<!-- docs: file NAME -->) or skipped with a reason")
        else:
            blocks.append(block)
        pending = None
        i = end + 1
    return blocks


def commands(code: str) -> list[str]:
    """The commands of a shell block: one per line, ``\\``-continued lines joined, comments dropped."""
    out, current = [], ""
    for line in code.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    if current:
        out.append(current)
    return out


def _paratrain_argv(command: str) -> list[str] | None:
    """The arguments after the ``paratrain`` program in a command line (None if it runs none); the
    command ends at the first shell operator (``>``, ``|``, ``&&``, ``;``, ``&``) or comment."""
    lex = shlex.shlex(command, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    try:
        tokens = list(lex)
    except ValueError:
        return None
    segment: list[str] = []
    for token in tokens + [";"]:
        if token and all(c in "();<>|&" for c in token):
            for i, word in enumerate(segment):
                if os.path.basename(word) == "paratrain":
                    return segment[i + 1:]
                if word == "-m" and segment[i + 1:i + 2] == ["paratrain"]:
                    return segment[i + 2:]
            segment = []
        else:
            segment.append(token)
    return None


def check_parse(command: str) -> str:
    """Parse a command's paratrain arguments with paratrain's own parser; '' if none, else what it checked."""
    argv = _paratrain_argv(command)
    if argv is None:
        return ""
    import argparse as _argparse

    from paratrain.cli.main import _parse, build_parser

    parser = build_parser()
    said: list[str] = []
    # what argparse prints (an error, --help) goes to `said`, not to this process's stdout/stderr,
    # which the other pages' threads share
    sub = next(a for a in parser._actions if isinstance(a, _argparse._SubParsersAction))
    for p in [parser, *sub.choices.values()]:
        p._print_message = lambda message, file=None: said.append(message or "")  # type: ignore[method-assign]
    try:
        _parse(parser, argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise DocError(f"paratrain rejects its arguments: {''.join(said).strip()}") from None
    return "paratrain " + " ".join(argv[:1])
