"""Help a user can read: no project history in user-facing text (a user cannot decode "seed 000"),
defaults shown, and every command's help renders."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from paratrain.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
HISTORY = re.compile(r"\bseeds? ?0\d\d\b|\bseed's\b", re.IGNORECASE)


def _subcommands():
    sub = next(a for a in build_parser()._actions if getattr(a, "choices", None))
    return sub.choices


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_help_renders_and_tells_no_project_history(command: str) -> None:
    text = _subcommands()[command].format_help()
    assert text and not HISTORY.search(text), HISTORY.search(text)


def test_readmes_and_docstrings_tell_no_project_history() -> None:
    found = []
    for path in [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        found += [f"{path.name}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]
    for path in sorted((ROOT / "paratrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                if HISTORY.search(doc):
                    found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}")
    assert found == []


def test_train_help_shows_defaults() -> None:
    text = _subcommands()["train"].format_help()
    assert re.search(r"default\s+mlp", text) and re.search(r"\(default\s+1\)", text)
