"""The selftest's clock: one budget in seconds, shared by the sections in order.

Each section gets a share of what is left when it starts (its deadline), so time a fast section
does not use flows to the ones after it, and a slow one cannot eat the rest of the run. A part
that does not fit before its deadline is not started: it is reported as skipped for the budget.

What a part costs is an estimate made on one machine; a slower machine (or a busy one) takes
longer. So the budget measures each part it runs (:meth:`Deadline.part`) and keeps the ratio of
measured to expected time, its *pace*: later parts of the same kind are judged by what they will
take here, not by the estimate (a part of a kind not yet run, by the pace of all parts so far).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["Budget", "Deadline"]


@dataclass
class Budget:
    """``seconds`` of wall time from now."""

    seconds: float
    start: float = field(default_factory=lambda: time.monotonic())
    ratios: dict[str, list[float]] = field(default_factory=dict)
    """Measured over expected seconds of each part run so far, by kind."""

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"selftest --budget {self.seconds:g} must be a positive number of seconds")

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    @property
    def left(self) -> float:
        return max(0.0, self.seconds - self.elapsed)

    def pace(self, kind: str | None = None) -> float:
        """How much longer than estimated parts take on this machine (0.5: twice as fast): the
        median ratio of the parts of ``kind`` run so far, else of every part, else 1."""
        ratios = self.ratios.get(kind or "") or [r for rs in self.ratios.values() for r in rs]
        return statistics.median(ratios) if ratios else 1.0

    def record(self, kind: str, expected: float, took: float) -> None:
        if expected > 0:
            self.ratios.setdefault(kind, []).append(took / expected)

    def section(self, share: float, at_least: float = 0.0) -> "Deadline":
        """A deadline for the next section: ``share`` (0–1) of what is left now, but ``at_least``
        seconds where that much is left (a section that cannot do anything in less)."""
        if not 0 < share <= 1:
            raise ValueError(f"a section's share {share} must be in (0, 1]")
        return Deadline(time.monotonic() + min(self.left, max(self.left * share, at_least)), self)


@dataclass(frozen=True)
class Deadline:
    at: float
    budget: Budget | None = None
    """Whose pace scales the estimates (none: estimates are taken as they are)."""

    @property
    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expect(self, seconds: float, kind: str = "") -> float:
        """What a part estimated at ``seconds`` will take on this machine, by the pace measured so far."""
        return seconds * (self.budget.pace(kind) if self.budget is not None else 1.0)

    def allows(self, seconds: float, kind: str = "") -> bool:
        """Whether a part estimated at ``seconds`` fits before the deadline, at this machine's pace."""
        return self.expect(seconds, kind) <= self.left

    @contextmanager
    def part(self, seconds: float, kind: str = "") -> Iterator[None]:
        """Time the part run inside, estimated at ``seconds``: it sets the pace of the parts after it."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            if self.budget is not None:
                self.budget.record(kind, seconds, time.monotonic() - t0)
