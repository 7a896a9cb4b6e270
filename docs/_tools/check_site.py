"""Check that the built site covers what it must: every name of ``paratrain.__all__`` in the API
reference, every ``paratrain`` subcommand in the command-line reference, and every extra of
``pyproject.toml`` in the install instructions.

    python docs/_tools/check_site.py build/docs
"""

from __future__ import annotations

import argparse
import sys
import tomllib
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    site = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "build" / "docs")
    # objects.inv (Sphinx's inventory, version 2): four header lines, then zlib-compressed lines of
    # "name domain:role priority uri display-name"
    body = zlib.decompress((site / "objects.inv").read_bytes().split(b"\n", 4)[4]).decode()
    entries = [line.split(" ", 2)[:2] for line in body.splitlines() if line.strip()]
    documented = {name for name, kind in entries if kind.startswith("py:")}
    labels = {name for name, kind in entries if kind == "std:label"}

    import paratrain
    from paratrain.cli.main import build_parser

    problems = [f"paratrain.{name} is in paratrain.__all__ but not in the API reference"
                for name in paratrain.__all__ if f"paratrain.{name}" not in documented]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    problems += [f"paratrain {name} is missing from the command-line reference"
                 for name in sub.choices if f"cli-paratrain-{name}" not in labels]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for page in (ROOT / "docs" / "getting-started.md", ROOT / "README.md"):
        text = page.read_text()
        problems += [f"{page.relative_to(ROOT)} does not name the extra [{extra}] of pyproject.toml"
                     for extra in extras if f"`{extra}`" not in text and f"[{extra}]" not in text]
    for problem in problems:
        print(f"docs: {problem}", file=sys.stderr)
    if not problems:
        print(f"docs: the API reference covers paratrain.__all__ ({len(paratrain.__all__)} names), the CLI "
              f"reference every subcommand ({len(sub.choices)}), the install sections every extra ({len(extras)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
