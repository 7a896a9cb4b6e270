"""Sphinx configuration of paratrain's documentation site: ``bash scripts/docs.sh`` builds it in strict
mode (every warning fails) and runs every code block of the pages (``docs/_tools/run_blocks.py``)."""

from __future__ import annotations

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(DOCS))  # paratrain from this checkout
sys.path.insert(0, os.path.join(DOCS, "_ext"))

project = "paratrain"
author = "paratrain contributors"
copyright = "paratrain contributors; Apache-2.0"  # noqa: A001 (the name Sphinx reads)

extensions = [
    "myst_parser",  # the pages are Markdown (MyST), as the README is
    "sphinx.ext.autodoc",  # the API reference, from the docstrings (their :func:/:class: roles are Sphinx's)
    "pyrefs",  # napoleon for Args:/Returns:, and references resolved to where the reference documents them
    "clidoc",  # the command-line reference, from paratrain's argparse parser
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_ext", "_tools", "requirements.txt"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links to a heading's slug

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True}

html_theme = "furo"
html_title = "paratrain"
html_show_sourcelink = False
