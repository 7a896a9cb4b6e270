"""What each strategy can run is asked of its class (never of its name), before any process starts."""

from __future__ import annotations

import pytest

from clitools import run_cli
from paratrain import strategies
from paratrain.config import ParallelConfig


@pytest.mark.parametrize("name, world, options, expected", [
    ("ddp", 4, None, 4),
    ("fsdp", 4, None, 4),
    ("ps", 3, None, 3),
    ("tensor", 4, strategies.TensorOptions(tp_size=2), 2),  # a tp group reads one batch
    ("tensor", 4, strategies.TensorOptions(), 1),           # tp over the whole world
    ("pipeline", 4, None, 1),                               # one replica
])
def test_data_parallel_size_for(name: str, world: int, options: object, expected: int) -> None:
    assert strategies.resolve(name).data_parallel_size_for(world, options) == expected


@pytest.mark.parametrize("name", [n for n, cls in strategies.STRATEGIES.items() if cls.processes == "one"])
def test_one_process_strategies_refuse_a_bigger_world(name: str) -> None:
    strategies.resolve(name).check_world(1)
    with pytest.raises(ValueError, match=f"strategy '{name}' runs in one process, but 2 were asked for"):
        strategies.resolve(name).check_world(2)


@pytest.mark.parametrize("strategy, precision, needle", [
    ("fsdp", "bf16-true", "use bf16-mixed (FSDP2 already keeps fp32 sharded master weights"),
    ("tensor", "fp16-true", "use bf16-mixed (FSDP2"),
    ("pipeline", "bf16-true", "not supported with strategy pipeline: use bf16-mixed or 32"),
    ("ps", "fp16-mixed", "each rank would skip overflowing steps on its own"),
    ("pipeline", "fp16-mixed", "each rank would skip overflowing steps on its own"),
])
def test_precision_support_is_the_strategys_fact(strategy: str, precision: str, needle: str) -> None:
    with pytest.raises(ValueError, match=".*") as e:
        ParallelConfig(strategy=strategy, precision=precision)
    assert needle in str(e.value)


@pytest.mark.parametrize("strategy", ["single", "dp", "ddp", "devices"])
def test_master_weights_are_accepted_where_supported(strategy: str) -> None:
    ParallelConfig(strategy=strategy, precision="bf16-true")


def test_devices_on_two_processes_is_refused_before_workers_start() -> None:
    """It used to start two workers that each died."""
    res = run_cli(["train", "--strategy", "devices", "--nproc-per-node", "2", "--no-progress", "--log-dir", "none"],
                  timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "strategy 'devices' runs in one process, but 2 were asked for" in lines[0], res.stderr
