"""``paratrain verify``: proof that the result does not depend on the number of workers.

* :mod:`~paratrain.verify.check`: the runs (world size 1 and N, accumulation, precision) and the report;
* :mod:`~paratrain.verify.worker`: one process of a run (a built-in config or a user's ``train(steps)``);
* :mod:`~paratrain.verify.probe`: global hooks that record samples, fingerprints and lr per step;
* :mod:`~paratrain.verify.compare`: per-tensor and loss-curve divergence;
* :mod:`~paratrain.verify.diagnose`: the classic mistakes, named with their fix.
"""

from .check import VerifyOptions, VerifyReport, format_report, verify_config, verify_entry
from .compare import Comparison, compare_runs
from .diagnose import Finding

__all__ = ["VerifyOptions", "VerifyReport", "Comparison", "Finding", "verify_config", "verify_entry",
           "compare_runs", "format_report"]
