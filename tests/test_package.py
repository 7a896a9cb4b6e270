"""The package as users receive it: the wheel's licence metadata and type marker, the one source of
the version, what the sdist holds, and a ``[test]`` extra that covers what the tests import."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = ast.literal_eval(re.search(r"^__version__ = (.+)$", (ROOT / "paratrain" / "_version.py").read_text(),
                                     re.MULTILINE).group(1))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--disable-pip-version-check", "-w", str(out), str(ROOT)], check=True, timeout=300)
    (path,) = out.glob("paratrain-*.whl")
    return zipfile.ZipFile(path)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("sdist")
    # setuptools from the test venv (the lock pins it), no index
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"],
                   cwd=ROOT, check=True, timeout=300, capture_output=True)
    (path,) = out.glob("paratrain-*.tar.gz")
    assert path.name == f"paratrain-{VERSION}.tar.gz"
    with tarfile.open(path) as t:
        return [m.name.split("/", 1)[1] for m in t.getmembers() if m.isfile()]


def _metadata(wheel: zipfile.ZipFile) -> str:
    return wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def test_wheel_names_apache_2_and_ships_py_typed(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert "paratrain/py.typed" in names
    assert "License-Expression: Apache-2.0" in _metadata(wheel).splitlines()
    licences = {n.split("/licenses/", 1)[1] for n in names if "/licenses/" in n}
    assert licences == {"LICENSE", "paratrain/data/files/DIGITS_NOTICE.txt"}
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_version_has_one_source(wheel: zipfile.ZipFile) -> None:
    """pyproject.toml reads the version from paratrain/_version.py; the wheel, the changelog and the
    package agree with it."""
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "paratrain._version.__version__"}
    assert f"Version: {VERSION}" in _metadata(wheel).splitlines()
    assert f"## [{VERSION}]" in (ROOT / "CHANGELOG.md").read_text()
    import paratrain

    assert paratrain.__version__ == VERSION


def test_sdist_holds_the_package_and_no_tests(sdist: list[str]) -> None:
    """The sdist builds the wheel and nothing else (MANIFEST.in says why the tests stay out)."""
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "PKG-INFO", "paratrain/py.typed",
            "paratrain/data/files/DIGITS_NOTICE.txt"} <= set(sdist)
    top = {n.split("/", 1)[0] for n in sdist if "/" in n}
    assert top == {"paratrain", "paratrain.egg-info"}, top  # no tests/, examples/, docs/, scripts/, ...
    assert not [n for n in sdist if "__pycache__" in n or n.endswith(".pyc")]
    tracked = subprocess.run(["git", "ls-files", "paratrain"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: cannot list the package's tracked files")
    missing = [n for n in tracked.stdout.split() if (ROOT / n).exists() and n not in sdist]
    assert not missing, f"tracked package files missing from the sdist: {missing}"


def _requirement_names(lines: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
            for line in lines if line.strip() and not line.strip().startswith(("#", "-"))}


def test_test_extra_covers_what_the_tests_import() -> None:
    """``pip install 'paratrain[test]'`` installs every third-party package the tests import (those that
    are missing only skip), and CI's requirements-common.txt, which the locks are built from, holds it."""
    test_extra = _requirement_names(PYPROJECT["project"]["optional-dependencies"]["test"])
    core = _requirement_names(PYPROJECT["project"]["dependencies"])
    local = {p.stem for d in ("tests", "examples", "scripts", "docs/_tools") for p in (ROOT / d).rglob("*.py")}
    local |= {p.name for p in (ROOT / "tests").rglob("*") if p.is_dir()}
    not_declared = {"tomli",  # tomllib's backport, imported only below Python 3.11
                    "torchvision"}  # the [data] extra: needs the torch build it was made for
    imported: dict[str, str] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("importorskip", "find_spec")
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                modules = [node.args[0].value]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local and top != "paratrain":
                    imported.setdefault(top, str(path.relative_to(ROOT)))
    distributions = importlib.metadata.packages_distributions()
    problems = []
    for module, where in sorted(imported.items()):
        if module in not_declared:
            continue
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [])}
        if not names:
            problems.append(f"{module} ({where}) is not installed in the test venv")
        elif not names & (test_extra | core):
            problems.append(f"{module} ({where}) comes from {sorted(names)}: not in [test] or the dependencies")
    assert not problems, problems
    common = _requirement_names((ROOT / "requirements-common.txt").read_text().splitlines())
    assert test_extra <= common, f"in [test] but not in requirements-common.txt: {sorted(test_extra - common)}"
