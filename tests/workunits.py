"""What one pytest-xdist worker runs as a whole (``tests/conftest.py``'s scheduler, :func:`scheduler`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pace

ROOT = Path(__file__).resolve().parents[1]

_ONE_WORKER = {"lab": "tests/lab/", "package": "tests/test_package.py"}
"""Tests that share a machine-wide resource run in one pytest-xdist worker, one after another: the
lab's network namespaces, Slurm and MPI daemons (session fixtures that two workers would both bring
up); the package's builds, which write build/ and paratrain.egg-info/ in the checkout."""


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs as a whole: a group of :data:`_ONE_WORKER`, a module with a
    module-scoped fixture (a trained reference run, a built wheel: split across two workers, each
    would build it), or else the test alone. Outside a group, a test marked ``waits`` is a unit of its own (one that
    uses a module's fixture would build it again in the worker that runs it)."""
    path = nodeid.replace("\\", "/").split("::")[0]
    group = next((g for g, prefix in _ONE_WORKER.items() if path.startswith(prefix)), None)
    if group is not None:
        return group
    if waits(nodeid):
        return nodeid
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


_WAITS_MARK = "waits"
_waits: dict[str, frozenset[str]] = {}


def waits(nodeid: str) -> bool:
    """Is the test marked ``@pytest.mark.waits`` (it mostly waits out a timeout or a signal)? Read from its
    module's source (the scheduler runs in pytest-xdist's controller, which imports no test module)."""
    path, _, rest = nodeid.replace("\\", "/").partition("::")
    name = rest.split("[", 1)[0].rsplit("::", 1)[-1]
    if path not in _waits:
        _waits[path] = _marked(path)
    return name in _waits[path]


def _marked(path: str) -> frozenset[str]:
    """The names of the functions in ``path`` decorated with ``pytest.mark.waits`` (or ``...waits(...)``)."""
    try:
        tree = ast.parse((ROOT / path).read_text())
    except (OSError, SyntaxError):
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for dec in node.decorator_list:
                dec = dec.func if isinstance(dec, ast.Call) else dec
                if isinstance(dec, ast.Attribute) and dec.attr == _WAITS_MARK:
                    names.add(node.name)
    return frozenset(names)


def scheduler(config, log=None):
    """pytest-xdist's load-scope scheduler over :func:`work_unit`, where the workers beyond the cores
    (:func:`pace.waiters`) take only the units whose tests are all marked ``waits``, and shut down when none is
    left; the others take those units too once their own are done."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            self._waiting: dict[str, bool] = {}  # scope -> all its tests are marked waits

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _waits(self, scope: str) -> bool:
            if scope not in self._waiting:
                self._waiting[scope] = all(map(waits, self.workqueue[scope]))
            return self._waiting[scope]

        def _assign_work_unit(self, node) -> None:
            waiter = node.gateway.id in pace.waiters(self.numnodes)
            scope = next((s for s in self.workqueue if self._waits(s) == waiter), None)
            if scope is None and not waiter:
                scope = next(iter(self.workqueue))  # the waiting units left, once nothing computes
            if scope is None:
                node.shutdown()
                return
            self.workqueue.move_to_end(scope, last=False)  # the unit xdist's own method pops
            super()._assign_work_unit(node)

    return WorkUnits(config, log)
