"""``paratrain run --strategy/--precision/--set`` and ``paratrain.toml``: the defaults of the script's
``Parallel()`` chosen at launch (issue 27, item 1). The code wins, then the command line, then the
file, then the built-in defaults; ``paratrain env`` shows them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from clitools import run_cli
from paratrain.config import ParallelConfig, parallel_defaults
from paratrain.env import defaults as launch_defaults
from paratrain.env.network import _ephemeral_range

pytestmark = pytest.mark.timeout(150)

REPORTS = """
import json, os, sys
import paratrain

pt = paratrain.Parallel(**json.loads(sys.argv[1]))
report = {"rank": pt.rank, "strategy": pt.describe()["strategy"], "precision": pt.config.precision,
          "seed": pt.config.seed, "comm_hook": pt.config.ddp.comm_hook, "port": int(os.environ["MASTER_PORT"])}
os.write(1, f"REPORT {json.dumps(report)}\\n".encode())  # one write: the ranks share the launcher's stdout
pt.close()
"""


def reports(stdout: str) -> list[dict]:
    return sorted((json.loads(found) for found in re.findall(r"REPORT (\{[^}]*\})", stdout)), key=lambda r: r["rank"])


def test_the_command_line_sets_every_ranks_defaults(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(REPORTS)
    res = run_cli(["run", "--nproc-per-node", "2", "--strategy", "ddp", "--precision", "bf16-mixed",
                   "--set", "parallel.seed=7", "--set", "parallel.ddp.comm_hook=fp16", "s.py", "{}"],
                  timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    got = reports(res.stdout)
    # the agent's MASTER_PORT lies outside the kernel's ephemeral range: no other bind(0) (gloo's listeners) takes it
    # between the agent's choice and rank 0's bind (paratrain.launch.torchrun)
    (lo, hi), ports = _ephemeral_range(), {r.pop("port") for r in got}
    assert len(ports) == 1 and not lo <= min(ports) <= hi, (ports, lo, hi)
    assert got == [{"rank": r, "strategy": "ddp", "precision": "bf16-mixed", "seed": 7,
                    "comm_hook": "fp16"} for r in (0, 1)]
    assert "in the code wins" not in res.stderr


def test_the_code_wins_then_the_command_line_then_paratrain_toml(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(REPORTS)
    (tmp_path / "paratrain.toml").write_text('[parallel]\nprecision = "32"\nseed = 5\nstrategy = "single"\n')
    res = run_cli(["run", "--nproc-per-node", "2", "--strategy", "fsdp", "--precision", "bf16-mixed", "s.py",
                   json.dumps({"strategy": "ddp"})], timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [{k: v for k, v in r.items() if k != "port"} for r in reports(res.stdout)] == [
        {"rank": r, "strategy": "ddp", "precision": "bf16-mixed", "seed": 5, "comm_hook": "none"} for r in (0, 1)]
    notices = [line for line in res.stderr.splitlines() if "in the code wins" in line]
    assert len(notices) == 1, res.stderr[-3000:]  # the main process only
    assert notices[0].endswith("paratrain: Parallel(strategy='ddp') in the code wins over the default set at launch: "
                               "strategy='fsdp' (paratrain run --strategy)"), notices


def test_paratrain_env_lists_the_defaults_and_where_each_came_from(tmp_path: Path) -> None:
    (tmp_path / "paratrain.toml").write_text('[parallel]\nstrategy = "ddp"\nseed = 5\n[parallel.ddp]\ncomm_hook = "fp16"\n')
    res = run_cli(["env"], timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    toml = tmp_path.resolve() / "paratrain.toml"
    for line in (f'  strategy = "ddp"  ({toml})', f"  seed = 5  ({toml})", f'  ddp.comm_hook = "fp16"  ({toml})'):
        assert line in res.stdout.splitlines(), res.stdout
    # inside a launched job: what the launcher set
    env = launch_defaults.encode({"precision": "bf16-mixed"}, {"precision": "paratrain run --precision"})
    res = run_cli(["env"], timeout=60, cwd=tmp_path, **env)
    assert '  precision = "bf16-mixed"  (paratrain run --precision)' in res.stdout.splitlines(), res.stdout


@pytest.mark.parametrize("overrides, error", [
    ({"parallel.strategy": "zero"}, "strategy 'zero' is unknown: use one of auto, single, dp, ddp, fsdp"),
    ({"parallel.precision": "fp7"}, "precision 'fp7' is unknown: use one of 32, tf32"),
    ({"parallel.nope": "1"}, "unknown key 'nope' in [parallel]: known keys are accelerator"),
    ({"parallel.seed": "x"}, "parallel.seed='x' is not an integer"),
    ({"epochs": "3"}, "--set epochs: paratrain run sets the defaults of Parallel() only"),
])
def test_bad_names_and_values_are_one_line_before_any_worker_starts(overrides: dict, error: str) -> None:
    with pytest.raises(ValueError) as e:
        parallel_defaults(None, overrides, cwd="/")
    assert error in str(e.value) and "\n" not in str(e.value)


def test_a_bad_value_on_the_command_line_stops_the_launch_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text("raise SystemExit('the script must not run')\n")
    res = run_cli(["run", "--strategy", "zero", "s.py"], timeout=60, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("paratrain run: error: strategy 'zero' is unknown: use one of auto, single, dp, ddp, fsdp, "
                               "tensor, pipeline, devices, ps"), lines
    (tmp_path / "paratrain.toml").write_text('[parallel]\nprecison = "bf16-mixed"\n')  # a typo in the project file
    res = run_cli(["run", "s.py"], timeout=60, cwd=tmp_path)
    assert res.returncode == 2 and "unknown key 'precison' in [parallel]: known keys are" in res.stderr, res.stderr


def test_the_code_wins_in_process_with_one_notice_on_the_main_process_only(monkeypatch, capsys) -> None:
    monkeypatch.setenv(launch_defaults.VARIABLE, json.dumps({"strategy": "ddp", "seed": "7", "global_batch": 32}))
    monkeypatch.setenv(launch_defaults.SOURCES, json.dumps({"strategy": "./paratrain.toml"}))
    cfg = ParallelConfig.of(None, {})
    assert (cfg.strategy, cfg.seed, cfg.global_batch) == ("ddp", 7, 32)
    cfg = ParallelConfig.of(None, {"seed": 7, "global_batch": 16, "precision": "bf16"})  # 7 agrees: not named
    assert (cfg.strategy, cfg.seed, cfg.global_batch, cfg.precision) == ("ddp", 7, 16, "bf16-mixed")
    ParallelConfig.of(None, {"seed": 7, "global_batch": 16})  # the same disagreement again: said once
    assert capsys.readouterr().err.splitlines() == [
        "paratrain: Parallel(global_batch=16) in the code wins over the default set at launch: "
        "global_batch=32 (PARATRAIN_PARALLEL)"]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert ParallelConfig.of(None, {"global_batch": 8}).global_batch == 8
    assert capsys.readouterr().err == ""  # not the main process
    given = ParallelConfig(global_batch=4)
    assert ParallelConfig.of(given, {}) is given  # a whole ParallelConfig is the code's choice
    monkeypatch.setenv(launch_defaults.VARIABLE, "ddp")
    with pytest.raises(ValueError, match="PARATRAIN_PARALLEL='ddp' is not a JSON table"):
        ParallelConfig.of(None, {})


def test_config_file_replaces_the_project_file_and_the_command_line_wins_over_it(tmp_path: Path) -> None:
    (tmp_path / "paratrain.toml").write_text('[parallel]\nstrategy = "fsdp"\n')
    (tmp_path / "job.yaml").write_text("parallel:\n  precision: bf16-mixed\n  seed: 4\n  ddp:\n    comm_hook: fp16\n")
    table, sources = parallel_defaults(tmp_path / "job.yaml", {"parallel.seed": "9"}, cwd=tmp_path,
                                       labels={"parallel.seed": "paratrain run --set parallel.seed"})
    assert table == {"precision": "bf16-mixed", "seed": "9", "ddp": {"comm_hook": "fp16"}}
    assert sources == {"precision": f"--config {tmp_path / 'job.yaml'}", "ddp.comm_hook": f"--config {tmp_path / 'job.yaml'}",
                       "seed": "paratrain run --set parallel.seed"}
    table, sources = parallel_defaults(None, {}, cwd=tmp_path)
    assert table == {"strategy": "fsdp"} and sources == {"strategy": os.path.join(os.path.abspath(tmp_path), "paratrain.toml")}


def test_paratrain_train_reads_the_project_file_says_so_once_and_flags_win(tmp_path: Path) -> None:
    """``paratrain train`` without ``--config`` reads ``./paratrain.toml`` (the whole config, as
    ``--config`` would): one notice on the launching process, none from its workers; flags win. No
    strategy given: ``auto``, ddp on 2 processes."""
    (tmp_path / "paratrain.toml").write_text('[parallel]\nseed = 5\n\n[optim]\nlr = 0.07\n')
    shown = run_cli(["train", "--print-config", "--set", "optim.lr=0.02"], timeout=60, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "seed = 5" in shown.stdout and 'strategy = "auto"' in shown.stdout and "lr = 0.02" in shown.stdout
    res = run_cli(["train", "--nproc-per-node", "2", "--max-steps", "1", "--no-progress", "--log-dir", "run"],
                  timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    notices = [line for line in res.stderr.splitlines() if "config from ./paratrain.toml" in line]
    assert len(notices) == 1, res.stderr[-3000:]
    assert "paratrain: ddp on 2 process(es)" in res.stdout + res.stderr  # strategy "auto" (the default) on 2
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert (result["world_size"], result["config"]["parallel"]["seed"]) == (2, 5), result
    other = tmp_path / "other.toml"
    other.write_text("[parallel]\nseed = 9\n")
    assert "seed = 9" in run_cli(["train", "--print-config", "--config", str(other)], timeout=60, cwd=tmp_path).stdout
