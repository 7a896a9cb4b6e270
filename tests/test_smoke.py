"""Smoke suite: the main commands end to end, a few steps each, on whichever torch is installed.

``scripts/test.sh`` runs the whole suite on the pinned CPU build of torch and then this module
(``pytest -m smoke``, together with the simulated-GPU tests) on PyPI's default CUDA build on a
machine without a GPU: the set-up most users have. Every CLI call runs in its own process group
with a hard time limit (see ``clitools``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import paratrain.strategies
from clitools import run_cli

pytestmark = [pytest.mark.smoke, pytest.mark.timeout(200)]

# strategy -> processes it runs on here: every registered strategy (its class says whether it runs in one process)
STRATEGIES = {name: 1 if cls.processes == "one" else 2 for name, cls in paratrain.strategies.STRATEGIES.items()}


def test_a_cuda_build_without_a_gpu_runs_on_the_cpu() -> None:
    """The CUDA wheel on a CPU machine: torch names ``cuda`` as its accelerator, but paratrain
    must pick the CPU and gloo (this crashed at start-up before)."""
    from paratrain.env.devices import select_backend
    from paratrain.env.process import init

    d = init()
    assert d.device == torch.device("cpu") and select_backend(d.device) == "gloo"


def train(tmp: Path, strategy: str, *extra: str, timeout: float = 120, fresh: bool = False) -> dict:
    n = STRATEGIES[strategy]
    args = ["train", "--strategy", strategy, "--max-steps", "3", "--no-progress", "--log-dir", str(tmp), *extra]
    if n > 1:
        args += ["--nproc-per-node", str(n)]
    res = run_cli(args, timeout=timeout, fresh=fresh)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((tmp / "result.json").read_text())


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_train_each_strategy(tmp_path: Path, strategy: str) -> None:
    # the commands fork from the session's zygote (clitools); ddp's starts a new interpreter, as users
    # start it: the installed package's start-up, from `python -m paratrain` to its forked workers
    result = train(tmp_path, strategy, fresh=strategy == "ddp")
    assert result["steps"] == 3 and result["world_size"] == STRATEGIES[strategy]
    assert result["test_count"] == 359  # every test sample counted once


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # a plain checkpoint, and a sharded one through DCP
def test_checkpoint_save_and_resume(tmp_path: Path, strategy: str) -> None:
    first = train(tmp_path, strategy, "--checkpoint-every", "2")
    assert first["steps"] == 3
    resumed = train(tmp_path, strategy, "--checkpoint-every", "2", "--resume", "--max-steps", "5")
    assert resumed["steps"] == 5 and resumed["resumed_from_step"] == 3  # the final checkpoint of the first run


def test_run_passes_script_arguments_untouched(tmp_path: Path) -> None:
    script = tmp_path / "echo_args.py"
    script.write_text(
        "import json, os, sys\n"
        "if os.environ['RANK'] == '0':\n"
        f"    open({str(tmp_path / 'args.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    user_args = ["--nproc", "7", "--node", "1", "--nnodes=3", "-m", "--help", "--master-addr", "x"]
    res = run_cli(["run", "--nproc-per-node", "2", str(script), *user_args], timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((tmp_path / "args.json").read_text()) == user_args


def test_verify_three_steps() -> None:
    res = run_cli(["verify", "--nproc-per-node", "2", "--steps", "3"], timeout=150)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "PASS" in res.stdout or "pass" in res.stdout.lower()


def test_bench_one_cell_per_strategy(tmp_path: Path) -> None:
    # One cell per strategy: the one-process ones at world 1, the others at world 2.
    res = run_cli(["bench", "--strategies", ",".join(STRATEGIES), "--world-sizes", "2", "--precisions", "32",
                   "--comm-hooks", "none", "--micro-batches", "1", "--epochs", "1", "--no-baseline", "--no-trap",
                   "--no-progress",
                   "--out", str(tmp_path)], timeout=190)
    assert res.returncode == 0, res.stderr[-3000:]
    cells = json.loads((tmp_path / "results.json").read_text())["cells"]
    ran = {c["strategy"] for c in cells if c["status"] == "ok"}
    expected = set(STRATEGIES) - {"dp"}  # DataParallel over 2 GPUs: skipped without them
    assert expected <= ran, (ran, res.stdout[-2000:])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
