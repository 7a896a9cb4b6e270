"""Check that the built site covers what it must: every name of ``paratrain.__all__`` in the API
reference, every ``paratrain`` subcommand in the command-line reference, every extra of
``pyproject.toml`` in the install instructions, and, where Chromium is installed (Debian's
``chromium``), that the front page renders in a headless browser with its navigation: every page of
the table of contents linked from the sidebar of the rendered DOM.

    python docs/_tools/check_site.py build/docs
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
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
    problems += _rendered_front_page(site)
    for problem in problems:
        print(f"docs: {problem}", file=sys.stderr)
    if not problems:
        print(f"docs: the API reference covers paratrain.__all__ ({len(paratrain.__all__)} names), the CLI "
              f"reference every subcommand ({len(sub.choices)}), the install sections every extra ({len(extras)})")
    return 1 if problems else 0


def _rendered_front_page(site: Path) -> list[str]:
    """The front page as a headless Chromium renders it: its sidebar links every built page."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("docs: no chromium here (apt-get install chromium): the rendered front page is not checked")
        return []
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", (site / "index.html").resolve().as_uri()]
    try:
        dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL).stdout
    except subprocess.TimeoutExpired:
        return ["chromium did not render the front page within 120 s"]
    nav = dom.partition('class="sidebar-tree"')[2]
    pages = sorted(str(p.relative_to(site)) for p in site.rglob("*.html")
                   if p.parent.name not in ("_modules", "_sources") and p.name not in ("genindex.html", "search.html",
                                                                                         "py-modindex.html", "index.html"))
    missing = [page for page in pages if f'href="{page}"' not in nav]
    if not nav or missing:
        return [f"the rendered front page has no navigation to {', '.join(missing) or 'any page'}"]
    print(f"docs: the front page renders in headless Chromium with its navigation ({len(pages)} pages)")
    return []


if __name__ == "__main__":
    sys.exit(main())
