"""The training loop (``fit``), its LR schedule and its logs."""

from .fit import FitResult, fit
from .logging import RunLogger, Throughput
from .schedule import warmup_linear_scaling

__all__ = ["fit", "FitResult", "RunLogger", "Throughput", "warmup_linear_scaling"]
