"""``paratrain env``, ``--version`` and ``train --print-config`` (TOML that ``--config`` reads back)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clitools import run_cli
from paratrain import __version__
from paratrain.config import TrainConfig, from_dict, load_config, parse_set, to_toml


def test_print_config_round_trips(tmp_path: Path) -> None:
    cfg = from_dict(TrainConfig, {
        "model": "cnn", "max_steps": 7, "log_dir": None,
        "parallel": {"strategy": "tensor", "precision": "bf16-mixed", "global_batch": 32, "clip_grad_norm": 1.5,
                     "tensor": {"tp_size": 2, "plan": {"fc1": "colwise", "fc2": "rowwise"}},
                     "pipeline": {"split_points": ["fc2"]}},
        "optim": {"lr": 0.1, "base_batch": 16},
    })
    path = tmp_path / "job.toml"
    path.write_text(to_toml(cfg))
    assert from_dict(TrainConfig, load_config(path)) == cfg


def test_print_config_cli_is_loadable(tmp_path: Path) -> None:
    res = run_cli(["train", "--print-config", "--strategy", "ddp", "--lr", "0.2", "--set", "parallel.ddp.comm_hook=fp16"],
                  timeout=60)
    assert res.returncode == 0, res.stderr
    (tmp_path / "c.toml").write_text(res.stdout)
    cfg = from_dict(TrainConfig, load_config(tmp_path / "c.toml"))
    assert cfg.parallel.strategy == "ddp" and cfg.optim.lr == 0.2 and cfg.parallel.ddp.comm_hook == "fp16"


def test_env_report_and_version() -> None:
    res = run_cli(["env"], timeout=60, RANK="3", SLURM_PROCID="3")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for needle in (f"paratrain {__version__}", "torch ", "paratrain picks: device", "gloo yes", "RANK=3",
                   "SLURM_PROCID=3", '[parallel]', 'strategy = "auto"'):
        assert needle in out, needle
    res = run_cli(["--version"], timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"paratrain {__version__}"


@pytest.mark.parametrize("value, fragment", [(True, "true"), (0.5, "0.5"), ("a\"b", '"a\\"b"'), ([1, 2], "[1, 2]")])
def test_toml_values(value: object, fragment: str) -> None:
    from dataclasses import make_dataclass

    cls = make_dataclass("C", [("x", object)])
    assert to_toml(cls(value)).strip() == f"x = {fragment}"


def test_with_overrides_returns_a_new_validated_config() -> None:
    import pickle

    base = TrainConfig(log_dir=None)
    cfg = base.with_overrides({"parallel.strategy": "ddp", "parallel.global_batch": "32", "optim.lr": 0.1,
                               "parallel.ddp.comm_hook": "fp16", "max_steps": "none"})
    assert (cfg.parallel.strategy, cfg.parallel.global_batch, cfg.optim.lr, cfg.parallel.ddp.comm_hook) == \
        ("ddp", 32, 0.1, "fp16") and cfg.max_steps is None
    assert base == TrainConfig(log_dir=None) and base.with_overrides({}) == base  # base unchanged
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # what a worker process receives
    for overrides, error in [
        ({"parallel.nope": 1}, r"unknown key 'nope' in \[parallel\]: known keys are "),
        ({"parallel.global_batch": "x"}, r"parallel.global_batch='x' is not an integer"),
        ({"parallel.strategy": "zero"}, r"strategy 'zero' is unknown: use one of "),
        ({"model.x": 1}, r"cannot set 'model.x': 'model' is not a section"),
        ({"parallel": 5}, r"parallel is a section of settings, not a value \(5\)"),
    ]:
        with pytest.raises(ValueError, match=error) as e:
            base.with_overrides(overrides)
        assert "\n" not in str(e.value)


def test_load_merges_file_and_overrides_before_validating(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('model = "cnn"\n[data]\ndataset = "cifar10"\n')  # invalid alone: cifar10 needs data_dir
    cfg = TrainConfig.load(path, {"data.data_dir": str(tmp_path), "parallel.seed": "3"})
    assert (cfg.model, cfg.data.data_dir, cfg.parallel.seed) == ("cnn", str(tmp_path), 3)
    assert TrainConfig.load() == TrainConfig()


def test_one_set_parser_for_train_and_bench() -> None:
    assert parse_set(["parallel.seed=3", "optim.lr=0.1", "parallel.seed=4", "model=a=b", "log_dir="]) == \
        {"parallel.seed": "4", "optim.lr": "0.1", "model": "a=b", "log_dir": ""}
    for bad in ("parallel.seed", "=1"):
        with pytest.raises(ValueError, match=f"--set '{bad}' is not KEY=VALUE, e.g. --set parallel.global_batch=128"):
            parse_set([bad])
    for command in ("train", "bench"):  # both commands read --set with parse_set: the same one-line error
        res = run_cli([command, "--set", "optim.lr"], timeout=60)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        assert f"paratrain {command}: error: --set 'optim.lr' is not KEY=VALUE, e.g. --set parallel.global_batch=128" \
            in lines[0]


@pytest.mark.parametrize("kwargs, error", [
    ({"global_batch": "8"}, "global_batch='8' must be an integer"),
    ({"global_batch": 8.5}, "global_batch=8.5 must be an integer"),
    ({"micro_batch": True}, "micro_batch=True must be an integer"),
    ({"seed": 0.5}, "seed=0.5 must be an integer"),
    ({"clip_grad_norm": "1.0"}, "clip_grad_norm='1.0' must be a number"),
    ({"clip_grad_norm": float("nan")}, "clip_grad_norm nan must be a positive number"),
    ({"seed": 2**70}, f"seed {2**70} does not fit in 64 bits"),
    ({"sync_batchnorm": "yes"}, "sync_batchnorm='yes' must be true or false"),
    ({"ddp": {"bucket_cap_mb": float("nan")}}, "ddp bucket_cap_mb nan must be positive"),
])
def test_parallel_options_of_the_wrong_type_are_refused_by_name(kwargs: dict, error: str) -> None:
    import paratrain

    with pytest.raises(ValueError, match=error.replace(".", r"\.")):
        paratrain.Parallel(**kwargs)


def test_parallel_integers_may_come_as_whole_floats_or_numpy() -> None:
    import numpy as np

    from paratrain.config import ParallelConfig

    config = ParallelConfig(global_batch=64 / 2, micro_batch=np.int64(8), clip_grad_norm=np.float32(1.0))
    assert (config.global_batch, config.micro_batch) == (32, 8) and type(config.global_batch) is int
    assert ParallelConfig(global_batch=np.float32(64)).global_batch == 64
    assert ParallelConfig(sync_batchnorm=np.bool_(True)).sync_batchnorm is True


def test_a_large_seed_draws_an_order_and_other_values_are_named() -> None:
    """A seed past 2**44 once overflowed the epoch permutation's seed; seeds that fitted keep their order."""
    from paratrain.data.sampler import epoch_permutation
    from paratrain.tracking import parse_log_to

    assert sorted(epoch_permutation(10, 2**50, 1).tolist()) == list(range(10))
    g = torch.Generator().manual_seed(3 * 1_000_003 + 1)
    assert epoch_permutation(10, 3, 1).tolist() == torch.randperm(10, generator=g).tolist()
    with pytest.raises(ValueError, match="log_to 5 must be a tracker name or a list of them"):
        parse_log_to(5)  # type: ignore[arg-type]


_RECORD = """
import json, os, sys
import paratrain.cli.env as env_command
from paratrain.cli.main import main
env_command.main = lambda args: json.loads("{bad")  # a ValueError whose class takes more than a message
main(["env"])
"""


def test_a_torchrun_worker_records_any_user_error_for_the_agent(tmp_path: Path) -> None:
    """In a torchrun worker the one-line error goes to the agent's error file, also for a ValueError
    subclass that cannot be rebuilt from one string (it once raised TypeError instead)."""
    import json
    import os
    import subprocess
    import sys

    error_file = tmp_path / "error.json"
    out = subprocess.run([sys.executable, "-c", _RECORD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file), "PARATRAIN_ERROR_DIR": str(tmp_path)})
    assert out.returncode == 2, out.stderr[-2000:]
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message.startswith("JSONDecodeError: Expecting property name"), message
