"""What one pytest-xdist worker runs as a whole (``tests/conftest.py``'s scheduler for ``-n 2``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_ONE_WORKER = {"lab": "tests/lab/", "package": "tests/test_package.py"}
"""Tests that share a machine-wide resource run in one pytest-xdist worker, one after another: the
lab's network namespaces, Slurm and MPI daemons (session fixtures that two workers would both bring
up); the package's builds, which write build/ and paratrain.egg-info/ in the checkout."""


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs as a whole: a group of :data:`_ONE_WORKER`, a module with a
    module-scoped fixture (a trained reference run, a built wheel: split across two workers, each
    would build it), or else the test alone."""
    path = nodeid.replace("\\", "/").split("::")[0]
    group = next((g for g, prefix in _ONE_WORKER.items() if path.startswith(prefix)), None)
    if group is not None:
        return group
    return path if _has_module_fixture(path) else nodeid


_MODULE_FIXTURE = re.compile(r"""@pytest\.fixture\(.*scope=["'](module|session)["']""")
_module_fixtures: dict[str, bool] = {}


def _has_module_fixture(path: str) -> bool:
    if path not in _module_fixtures:
        try:
            text = (ROOT / path).read_text()
        except OSError:
            text = ""
        _module_fixtures[path] = bool(_MODULE_FIXTURE.search(text))
    return _module_fixtures[path]
