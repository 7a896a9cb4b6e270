"""paratrain's modules import each other without a cycle (issue 38, item 5): the import graph read
off the source by ``scripts/import_graph.py`` (function-level imports included; not those under
``if TYPE_CHECKING:``, which never run; not a package's ``__init__`` re-exporting its submodules)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import import_graph  # noqa: E402


def test_no_module_of_paratrain_imports_one_that_imports_it_back():
    top, every, local = import_graph.design_graphs()
    assert len(every) > 100 and every["paratrain.parallel"] and local, "the import graph was not read"
    assert import_graph.cycles(every) == []


def test_a_cycle_is_found():
    assert import_graph.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
