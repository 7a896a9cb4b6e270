"""``paratrain.bench.overhead``: the interleaving order and the overhead line's arithmetic and words
(no timing asserts: the numbers are made up)."""

import itertools

import pytest

from paratrain.bench.matrix import Cell
from paratrain.bench.overhead import Overhead, interleave, round_ratios
from paratrain.bench.report import _overhead_lines
from paratrain.bench.runner import BenchResult, CellResult, _overhead


def test_interleave_runs_blocks_in_abba_order_after_untimed_warmup():
    seen = []

    def loop(name):
        for i in itertools.count():
            seen.append((name, i))
            yield i

    out = interleave({"plain": loop("plain"), "paratrain": loop("paratrain")}, steps=5, block=2, warmup=1,
                     first="paratrain")
    names = [n for n, _ in seen]
    assert names == ["paratrain", "plain"] + ["paratrain"] * 2 + ["plain"] * 2 + ["plain"] * 2 + ["paratrain"] * 2 \
        + ["paratrain", "plain"]
    assert [len(b) for b in out["wall"]["plain"]] == [2, 2, 1] and [len(b) for b in out["cpu"]["paratrain"]] == [2, 2, 1]
    assert out["outputs"]["plain"] == [1, 2, 3, 4, 5]  # the warm-up step's output is not kept


def test_interleave_with_sync_gives_each_step_its_block_mean():
    syncs = []
    out = interleave({"a": itertools.count(), "b": itertools.count()}, steps=3, block=3, sync=lambda: syncs.append(1))
    assert len(syncs) == 4  # before and after each block
    assert len(set(out["wall"]["a"][0])) == 1 and len(out["wall"]["a"][0]) == 3


def test_round_ratios_are_medians_per_round():
    assert round_ratios([[2.0, 4.0, 3.0], [1.0]], [[1.0, 1.0, 2.0], [2.0]]) == [3.0, 0.5]
    assert round_ratios([[1.0], []], [[1.0], []]) == [1.0]


@pytest.mark.parametrize("rounds, noise, verdict", [
    ([0.97, 1.02, 1.10], True, "within noise"),
    ([1.0, 1.2], True, "within noise"),  # the spread touching 1.0 covers it
    ([1.03, 1.08, 1.20], False, "paratrain slower in every round"),
    ([0.90, 0.95], False, "paratrain faster in every round"),
    ([0.9], False, "one round: no spread to judge noise by"),
])
def test_overhead_says_within_noise_when_the_spread_covers_one(rounds, noise, verdict):
    o = Overhead(ratio=1.04, rounds=rounds)
    assert o.within_noise is noise and o.verdict() == verdict
    assert o.describe().startswith(f"1.04x (rounds {min(rounds):.2f}–{max(rounds):.2f}, {len(rounds)} interleaved round")
    assert o.describe().endswith(f"{verdict})")


def test_overhead_from_rounds_pools_steps_and_reports_cpu():
    o = Overhead.from_rounds([[1.1, 1.1], [0.9, 0.9]], [[1.0, 1.0], [1.0, 1.0]],
                             [[2.0], [2.0]], [[1.0], [1.0]])
    assert o.rounds == pytest.approx([1.1, 0.9]) and o.ratio == pytest.approx(1.0) and o.cpu_ratio == 2.0
    assert o.describe() == "1.00x (rounds 0.90–1.10, 2 interleaved rounds: within noise; CPU time 2.00x)"


def test_runner_combines_ranks_slowest_wall_mean_cpu():
    def rank(wall_ours, wall_plain, cpu_ours):
        return {"overhead": {"wall": {"paratrain": [wall_ours], "plain": [wall_plain]},
                             "cpu": {"paratrain": [cpu_ours], "plain": [[1.0, 1.0]]}}}

    o = _overhead([rank([1.0, 2.0], [1.0, 1.0], [1.0, 3.0]), rank([3.0, 1.0], [1.0, 1.0], [3.0, 1.0])])
    assert o.rounds == [2.5] and o.cpu_ratio == 2.0
    assert _overhead([{"status": "ok"}]) is None


def test_overhead_line_in_the_table():
    base = CellResult(cell=Cell(strategy="plain-ddp", world_size=2, global_batch=64, group="baseline"), status="ok",
                      overhead=Overhead(ratio=1.85, rounds=[1.3, 2.1, 1.9]))
    res = BenchResult(meta={}, results=[base])
    (line,) = _overhead_lines(res)
    assert line.startswith("overhead: paratrain ddp x2 takes 1.85x (rounds 1.30–2.10, 3 interleaved rounds: "
                           "paratrain slower in every round)")
    row = base.row()
    assert row["overhead_ratio"] == 1.85 and row["overhead_within_noise"] is False and "overhead" not in row


def test_the_verdict_names_what_was_timed():
    """selftest times accelerate and lightning against the hand-written loop too: their rows name them."""
    o = Overhead.from_rounds([[1.2], [1.3]], [[1.0], [1.0]], subject="lightning")
    assert o.verdict() == "lightning slower in every round"
