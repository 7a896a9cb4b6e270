"""The training loop (``fit``), its LR schedule and its logs."""

from .fit import FitResult, fit, planned_steps
from .guard import NonFiniteLossError
from .logging import RunLogger, Throughput
from .schedule import build_schedule, lr_factor, warmup_linear_scaling

__all__ = ["fit", "FitResult", "planned_steps", "NonFiniteLossError", "RunLogger", "Throughput",
           "build_schedule", "lr_factor", "warmup_linear_scaling"]
