"""``paratrain.bench.report``'s chart: which bars, labels, gaps and legend entries it draws (no pixels read)."""

from paratrain.bench.matrix import BASELINE, Cell
from paratrain.bench.report import Bar, chart_bars, legend_entries, write_chart
from paratrain.bench.runner import BenchResult, CellResult


def _ok(cell, sps, acc=0.9):
    return CellResult(cell=cell, status="ok", samples_per_s=sps, efficiency=sps / 1000 / cell.world_size,
                      test_accuracy=acc, seconds_per_epoch=1.0)


def _results():
    ddp = Cell(strategy="ddp", world_size=2, global_batch=64)
    return [
        _ok(Cell(strategy="single", global_batch=64), 1000.0, 0.95),
        CellResult(cell=Cell(strategy="dp", world_size=2, global_batch=64), status="skipped",
                   reason="DataParallel over 2 GPUs needs 2 GPUs in one process; 0 visible " + "x" * 80),
        _ok(ddp, 1500.0),
        _ok(Cell(strategy=BASELINE, world_size=2, global_batch=64, group="baseline"), 1600.0),
        # the trap's same-batch cell trained exactly what the matrix's ddp cell did: the runner copied it
        _ok(Cell(strategy="ddp", world_size=2, global_batch=64, group="trap"), 1500.0),
        _ok(Cell(strategy="ddp", world_size=2, global_batch=128, group="trap"), 2500.0, 0.8),
        CellResult(cell=Cell(strategy="ddp", world_size=2, global_batch=128, base_batch=64, lr_warmup_steps=5,
                             group="trap"), status="failed", reason="timed out"),
    ]


def test_chart_bars_merge_identical_runs_and_keep_gaps_with_reasons():
    bars = chart_bars(_results())
    assert [b.label for b in bars] == ["single", "dp x2", "ddp x2 = ddp x2 batch 64", "plain DDP (hand-written) x2",
                                       "ddp x2 batch 128", "ddp x2 batch 128 lr x2 + warmup 5"]
    assert [b.samples_per_s for b in bars] == [1000.0, None, 1500.0, 1600.0, 2500.0, None]
    assert bars[0].note == "acc 95.0%" and bars[4].note == "acc 80.0%"
    assert bars[1].note.startswith("skipped: DataParallel over 2 GPUs") and len(bars[1].note) == 70
    assert bars[1].note.endswith("…") and bars[5].note == "failed: timed out"
    assert [b.group for b in bars] == ["matrix", "matrix", "matrix", "baseline", "trap", "trap"]


def test_legend_names_each_kind_shown_once_and_the_gaps():
    bars = chart_bars(_results())
    texts = [t for _, t in legend_entries(bars)]
    assert texts == ["matrix cells", "hand-written baseline", "effective-batch cells",
                     "not run here (gap, reason on the bar's line)"]
    only = [Bar(label="single", group="matrix", samples_per_s=1.0, efficiency=1.0)]
    assert [t for _, t in legend_entries(only)] == ["matrix cells"]


def test_chart_png_is_written(tmp_path):
    res = BenchResult(meta={"model": "mlp", "dataset": "digits", "global_batch": 64}, results=_results())
    assert write_chart(res, str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_seconds_keep_three_digits_for_tiny_epochs():
    from paratrain.bench.report import _seconds

    assert (_seconds(1.234), _seconds(0.0312), _seconds(0.1), _seconds(None)) == ("1.23", "0.0312", "0.10", "-")
