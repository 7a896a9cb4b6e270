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
