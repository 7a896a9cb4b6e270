"""paratrain's ``ddp`` against the hand-written DDP loop, measured honestly: both loops in the same
processes, interleaved step block by step block, so that other load on the machine hits both alike.

Two loops that do the same work (same model and initial weights, same data, per-worker batch,
optimizer and loss) are generators yielding once per optimizer step:

* ``plain``: :func:`paratrain.bench.baseline.plain_ddp_steps`, a typical DDP loop written by hand;
* ``paratrain``: :func:`parallel_steps`, the same loop through ``Parallel`` (``setup``,
  ``train_loader``, ``backward``).

:func:`interleave` steps them in blocks in ABBA order (round r runs plain then paratrain when r is
even, the other way round when it is odd), timing every step's wall and process CPU time. A round's
ratio is the median paratrain step over the median plain step of that round; :class:`Overhead`
says how far the rounds spread and whether the spread covers 1.0 (then the difference is within
the noise of this machine). ``paratrain bench``'s baseline cell and ``benchmarks/overhead.py``
both measure this way.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator

import torch
from torch import nn

__all__ = ["VARIANTS", "parallel_steps", "interleave", "round_ratios", "Overhead"]

VARIANTS = ("plain", "paratrain")


def parallel_steps(pt: Any, net: nn.Module, optimizer: torch.optim.Optimizer, trainset: Any
                   ) -> Generator[Any, None, None]:
    """The hand-written loop's twin through ``Parallel`` ``pt`` (which joins an existing process
    group): the first ``next()`` sets up and yields the wrapped model, every later one runs one
    training step and yields its loss (not synchronised)."""
    criterion = nn.CrossEntropyLoss()
    net, optimizer = pt.setup(net, optimizer)
    trainloader = pt.train_loader(trainset)
    yield net  # set up
    while True:
        for images, labels in trainloader:  # already on the device; the next pass is the next epoch
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            pt.backward(loss)
            optimizer.step()
            yield loss.detach()


def interleave(loops: dict[str, Iterator[Any]], steps: int, block: int, warmup: int = 0,
               first: str | None = None, sync: Callable[[], None] | None = None) -> dict[str, Any]:
    """Step every loop ``warmup`` times untimed, then ``steps`` timed steps each, in blocks of
    ``block`` steps, ABBA: round r runs the loops in order for even r and reversed for odd r
    (``first`` leads round 0). Returns ``{"wall": {name: [[s, ...] per round]}, "cpu": ...,
    "outputs": {name: [what each timed step yielded]}}``.

    With ``sync`` (a CUDA device's synchronize) a block is timed as a whole between two syncs and
    each of its steps gets the block's mean: a step's own time means nothing on an async device."""
    order = list(loops)
    if first is not None:
        order.remove(first)
        order.insert(0, first)
    for _ in range(warmup):
        for name in order:
            next(loops[name])
    wall: dict[str, list[list[float]]] = {n: [] for n in order}
    cpu: dict[str, list[list[float]]] = {n: [] for n in order}
    outputs: dict[str, list[Any]] = {n: [] for n in order}
    for r in range(-(-steps // block)):
        for name in (order if r % 2 == 0 else order[::-1]):
            w, c = [], []
            n = min(block, steps - r * block)
            if sync is not None:
                sync()
                t0, c0 = time.perf_counter(), time.process_time()
                outputs[name] += [next(loops[name]) for _ in range(n)]
                sync()
                w, c = [(time.perf_counter() - t0) / n] * n, [(time.process_time() - c0) / n] * n
            else:
                for _ in range(n):
                    t0, c0 = time.perf_counter(), time.process_time()
                    outputs[name].append(next(loops[name]))
                    w.append(time.perf_counter() - t0)
                    c.append(time.process_time() - c0)
            wall[name].append(w)
            cpu[name].append(c)
    return {"wall": wall, "cpu": cpu, "outputs": outputs}


def round_ratios(ours: list[list[float]], theirs: list[list[float]]) -> list[float]:
    """Per round: median of ``ours`` over median of ``theirs`` (rounds without steps are left out)."""
    return [statistics.median(a) / statistics.median(b) for a, b in zip(ours, theirs) if a and b]


@dataclass(kw_only=True)
class Overhead:
    """paratrain's step time over the hand-written loop's, from interleaved rounds."""

    ratio: float
    """Median paratrain step over median plain step, all rounds pooled."""
    rounds: list[float]
    """The per-round ratios."""
    cpu_ratio: float | None = None
    """The same ratio of process CPU time per step (other jobs disturb it less than wall time)."""
    subject: str = "paratrain"
    """What is timed against the hand-written loop (``accelerate``, ``lightning`` in selftest's speed rows)."""

    @classmethod
    def from_rounds(cls, ours: list[list[float]], theirs: list[list[float]],
                    ours_cpu: list[list[float]] | None = None, theirs_cpu: list[list[float]] | None = None,
                    subject: str = "paratrain") -> Overhead:
        def pooled(a: list[list[float]], b: list[list[float]]) -> float:
            return statistics.median([s for r in a for s in r]) / statistics.median([s for r in b for s in r])

        cpu = pooled(ours_cpu, theirs_cpu) if ours_cpu and theirs_cpu else None
        return cls(ratio=pooled(ours, theirs), rounds=round_ratios(ours, theirs), cpu_ratio=cpu, subject=subject)

    @property
    def low(self) -> float:
        return min(self.rounds, default=self.ratio)

    @property
    def high(self) -> float:
        return max(self.rounds, default=self.ratio)

    @property
    def within_noise(self) -> bool:
        """Does the spread of the per-round ratios cover 1.0? (One round cannot say: False.)"""
        return len(self.rounds) > 1 and self.low <= 1.0 <= self.high

    def verdict(self) -> str:
        if self.within_noise:
            return "within noise"
        if len(self.rounds) < 2:
            return "one round: no spread to judge noise by"
        return f"{self.subject} {'slower' if self.low > 1.0 else 'faster'} in every round"

    def describe(self) -> str:
        """``1.04x (rounds 0.97–1.10, 8 interleaved rounds: within noise; CPU time 1.01x)``."""
        n = len(self.rounds)
        cpu = "" if self.cpu_ratio is None else f"; CPU time {self.cpu_ratio:.2f}x"
        return (f"{self.ratio:.2f}x (rounds {self.low:.2f}–{self.high:.2f}, {n} interleaved round{'s' * (n != 1)}: "
                f"{self.verdict()}{cpu})")
