"""Timing for the benchmarks: paired variants run interleaved in ABBA order (so that other load hits
every variant alike), a block's median time with its wall and CPU time, and the machine's line."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable

import torch

__all__ = ["cpu_model", "load", "block", "abba", "with_threads"]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.machine()


def load() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


def block(fn: Callable[[], object], reps: int) -> tuple[float, float, float]:
    """(median seconds per call, wall seconds, CPU seconds) over ``reps`` calls."""
    times = []
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), time.perf_counter() - w0, time.process_time() - c0


def abba(title: str, variants: dict[str, Callable[[], object]], baselines: dict[str, str], runs: int, reps: int,
         setups: dict[str, Callable[[], None]] | None = None) -> dict[str, float]:
    """Time ``variants`` interleaved ABBA; print one line each; return the median seconds per call."""
    setups = setups or {}
    names = list(variants)
    for name in names:
        setups.get(name, lambda: None)()
        for _ in range(3):
            variants[name]()
    per_run: dict[str, list[float]] = {n: [] for n in names}
    wall = dict.fromkeys(names, 0.0)
    cpu = dict.fromkeys(names, 0.0)
    for r in range(runs):
        for name in names if r % 2 == 0 else names[::-1]:
            setups.get(name, lambda: None)()
            med, w, c = block(variants[name], reps)
            per_run[name].append(med)
            wall[name] += w
            cpu[name] += c
    print(f"\n{title}")
    print(f"  {'variant':34s} {'ms/call':>9s} {'speed-up':>9s} {'(range)':>13s} {'vs':>22s} {'cores busy':>10s} "
          f"{'CPU ms/call':>11s}")
    out = {}
    for name in names:
        t = statistics.median(per_run[name])
        out[name] = t
        base = baselines.get(name)
        if base is None or base == name:
            sp, rng, vs = "1.00x", "", ""
        else:
            ratios = [b / v for b, v in zip(per_run[base], per_run[name])]
            sp = f"{statistics.median(ratios):.2f}x"
            rng = f"({min(ratios):.2f}-{max(ratios):.2f})"
            vs = base
        print(f"  {name:34s} {t * 1e3:9.2f} {sp:>9s} {rng:>13s} {vs:>22s} {cpu[name] / wall[name]:10.2f} "
              f"{cpu[name] / (runs * reps) * 1e3:11.3f}")
    return out


def with_threads(n: int) -> Callable[[], None]:
    return lambda: torch.set_num_threads(n)
