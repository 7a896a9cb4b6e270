"""The examples run: one loop under several strategies trains the same weights."""

from __future__ import annotations

import re

import pytest

from clitools import run_cli

pytestmark = pytest.mark.timeout(150)
EXAMPLE = "examples/one_loop_every_strategy.py"


def _result(stdout: str) -> tuple[float, float]:
    m = re.search(r"test accuracy ([0-9.]+), weights checksum (-?[0-9.]+)", stdout)
    assert m, stdout
    return float(m.group(1)), float(m.group(2))


def test_one_loop_every_strategy_trains_the_same_weights():
    single = run_cli(["run", "--nproc-per-node", "1", EXAMPLE, "--strategy", "single", "--steps", "20"], timeout=100)
    assert single.returncode == 0, single.stderr[-3000:]
    for strategy in ("pipeline", "ps"):
        res = run_cli(["run", "--nproc-per-node", "2", EXAMPLE, "--strategy", strategy, "--steps", "20"], timeout=100)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.count("checksum") == 1  # printed on the main process only
        (acc, checksum), (acc1, checksum1) = _result(res.stdout), _result(single.stdout)
        # checksums are printed with 4 decimals (each rounded by up to 5e-5): 2e-4 leaves 1e-4 for
        # float32 rounding of the training itself
        assert acc == acc1 and abs(checksum - checksum1) <= 2e-4, (strategy, res.stdout, single.stdout)


def _code_lines(path: str) -> list[str]:
    """The file's lines after its module docstring (the docstring says which script it is)."""
    import ast
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / path).read_text()
    body = ast.parse(text).body
    start = body[1].lineno - 1 if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 0
    return text.splitlines()[start:]


def test_seed_script_converts_in_five_edited_lines(tmp_path):
    """``seed000_after.py`` is ``seed000_before.py`` with at most 5 lines edited (added, removed or
    changed: a changed line counts once), and it runs on 1 and 2 processes."""
    import difflib

    before, after = _code_lines("examples/seed000_before.py"), _code_lines("examples/seed000_after.py")
    edited = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes():
        if tag != "equal":
            edited += max(i2 - i1, j2 - j1)
    assert edited <= 5, edited
    for n in ("1", "2"):
        res = run_cli(["run", "--nproc-per-node", n, "examples/seed000_after.py", "--epochs", "1", "--steps", "3",
                       "--batch-size", "16", "--checkpoint", str(tmp_path / f"seed-{n}.pt")], timeout=100)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.count("Accuracy of the network") == 1 and "Warning" not in res.stderr, (res.stdout, res.stderr)
        assert (tmp_path / f"seed-{n}.pt").is_file()
