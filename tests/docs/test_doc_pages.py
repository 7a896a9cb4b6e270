"""Every code block of the README and the documentation's pages runs (``docs/_tools/run_blocks.py``), one page
per test: the pages run beside the suite's other tests (pytest-xdist), not after them.

``bash scripts/docs.sh`` runs them all at once, for someone working on the docs; CI runs them here, and the site
itself (Sphinx, strict) beside the suite (``scripts/docs.sh --site``). A page's ``paratrain`` commands fork from
the suite's zygote (tests/zygote.py), as they do from run_blocks' own; its time limits get this machine's room
(tests/pace.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import zygote
from pace import scaled

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "_tools"))

import run_blocks  # noqa: E402

PAGES = run_blocks.default_files()


def test_the_pages_run_nearly_every_block(capsys):
    """At most 10 blocks are only parsed or skipped (run_blocks' --max-skipped): the markers of every page are
    read and checked, nothing runs."""
    assert run_blocks.main(["--list"]) == 0, capsys.readouterr()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_block_of_the_page_runs(page, monkeypatch):
    if zygote.enabled():  # the page's `paratrain` commands fork from the session's zygote (torch imported once)
        monkeypatch.setenv("PARATRAIN_ZYGOTE", zygote.start_server(dict(os.environ)))
        monkeypatch.setattr(run_blocks, "SHIMS", [os.path.dirname(zygote.shim())])
        monkeypatch.setattr(run_blocks, "POPEN", zygote.ZygotePopen)  # and its Python blocks' process
    monkeypatch.setattr(run_blocks, "ROOM", scaled(1.0))
    try:
        run_blocks.run_page(page, run_blocks.Tally(), list_only=False)
    except run_blocks.DocError as e:
        pytest.fail(str(e), pytrace=False)

