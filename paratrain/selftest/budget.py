"""The selftest's clock: one budget in seconds, shared by the sections in order.

Each section gets a share of what is left when it starts (its deadline), so time a fast section
does not use flows to the ones after it, and a slow one cannot eat the rest of the run. A part
that does not fit before its deadline is not started: it is reported as skipped for the budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Budget"]


@dataclass
class Budget:
    """``seconds`` of wall time from now."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"selftest --budget {self.seconds:g} must be a positive number of seconds")

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    @property
    def left(self) -> float:
        return max(0.0, self.seconds - self.elapsed)

    def section(self, share: float, at_least: float = 0.0) -> "Deadline":
        """A deadline for the next section: ``share`` (0–1) of what is left now, but ``at_least``
        seconds where that much is left (a section that cannot do anything in less)."""
        if not 0 < share <= 1:
            raise ValueError(f"a section's share {share} must be in (0, 1]")
        return Deadline(time.monotonic() + min(self.left, max(self.left * share, at_least)))


@dataclass(frozen=True)
class Deadline:
    at: float

    @property
    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def allows(self, seconds: float) -> bool:
        """Whether a part expected to take ``seconds`` fits before the deadline."""
        return seconds <= self.left
