"""``paratrain bench``: the strategies' comparison table for any model — strategies × world sizes ×
precisions × comm hooks, a hand-written DDP baseline, and the effective-batch trap.

* :mod:`~paratrain.bench.matrix`: the cells, and why a cell cannot run here;
* :mod:`~paratrain.bench.runner`: each cell in fresh processes with a hard time limit;
* :mod:`~paratrain.bench.worker`: what one process of a cell does (timing after warm-up);
* :mod:`~paratrain.bench.measure`: bytes communicated and peak memory;
* :mod:`~paratrain.bench.baseline`: the hand-written plain-PyTorch DDP loop;
* :mod:`~paratrain.bench.overhead`: paratrain's ddp and that loop interleaved (ABBA), the overhead line;
* :mod:`~paratrain.bench.report`: the table, JSON, CSV and PNG chart;
* :mod:`~paratrain.bench.predict`: the scaling model (``--predict``): compute + ring communication;
* :mod:`~paratrain.bench.scaling`: its inputs measured here (gloo all-reduces, the bench's cells).
"""

from .matrix import BenchSpec, Cell, build_matrix, full_spec, quick_spec
from .report import format_table, write_all
from .runner import BenchResult, CellResult, recommend, run_bench

__all__ = ["BenchSpec", "Cell", "CellResult", "BenchResult", "build_matrix", "quick_spec", "full_spec",
           "run_bench", "recommend", "format_table", "write_all"]
