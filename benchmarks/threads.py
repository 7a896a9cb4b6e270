"""Threads inside one process: what overlaps, measured.

What it measures
    (0) Whether two branches run at the same time at all, for each way of forking and for backward:
        each branch announces that it started and waits (up to 1 s) for the other; they meet only
        if both ran at once. Load slows this down but cannot fake it, so this part holds on a
        busy machine too.
    (a) Independent branches, one intra-op thread per branch (``torch.set_num_threads(1)``, 2
        inter-op threads), forward pass and training step (zero_grad + forward + backward):

        * the seed's example, ``compute(x) = x * x`` forked twice, on a scalar (the seed's own
          shapes: what a fork costs) and on 1024x1024 matrices with ``x @ x`` (a heavier variant);
        * a two-tower model (two 3-layer MLPs, 512 -> 1024 -> 1024 -> 256, batch 128, a linear
          head on both outputs).

        Variants: ``sequential`` (one branch after the other), ``eager jit.fork``
        (``torch.jit.fork`` called from Python: torch runs the function before returning, so
        ~1.0x is expected), ``scripted sequential`` and ``scripted jit.fork`` (the model under
        ``torch.jit.script``, with the forks inside TorchScript: the inter-op pool), ``fork_map``
        (paratrain, Python threads) and ``fork_map scripted`` (paratrain on scripted branches: its
        TorchScript launcher). Speed-ups are against ``sequential``, or against ``scripted
        sequential`` for the scripted variants (TorchScript changes the step time by itself).
    (b) ``devices`` on two CPU parts (an MLP of 4 Linear(1024, 1024) layers and a head, cut in the
        middle), per training step, at batch 1024 and 256 (``--batches``): ``micro_batches=1`` (the
        parts one after another) against ``micro_batches=4`` pipelined (forward and backward), pipelined
        forward with the autograd engine's backward (``pipelined_backward=False``: what shows that
        one backward call runs the CPU nodes one at a time), and the 4 chunks run one after
        another (what chunking alone costs: a matmul over 64 rows runs at a lower rate than over
        256). Forward-only times (``torch.no_grad``) too, at the first batch.
    (c) The same shapes with intra-op threading instead: one branch (or the whole split, at the
        first of ``--batches``) at a time with 2 intra-op threads, so that inter-op (branches) and
        intra-op (kernels) can be compared for each shape.

How
    Each group's variants run in blocks of ``--reps`` calls, interleaved A B C ... then ... C B A
    (ABBA) for ``--runs`` runs, after 3 untimed warm-up calls each (TorchScript's profiling
    runs). A block's time is the median of its calls; a variant's time is the median over runs;
    the speed-up is the median of the per-run paired ratios, with their range. ``cores busy`` is
    the process CPU time over wall time during the variant's blocks: near 2 when two branches ran
    at once on 2 cores, near 1 when they did not, lower when other jobs took the cores (then no
    variant can beat sequential: the speed-ups say nothing about overlap). ``CPU ms/call`` is the
    process CPU time per call, all threads: the work a variant does, which contention disturbs
    less than wall time (what forking or chunking adds shows there). The load average is printed
    before and after: on a shared machine, read the speed-ups alongside it and ``cores busy``.

Usage::

    python benchmarks/threads.py [--runs 6] [--reps 5] [--only 0|a|b|c] [--batches 1024,256]
    python benchmarks/threads.py --smoke   # one run of one call, batches 256,64: checks that it runs (CI)
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import threading
import time
import warnings
from typing import Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import paratrain  # noqa: E402
import paratrain.strategies.devices as devices_mod  # noqa: E402
from paratrain.env.base import ProcessInfo  # noqa: E402
from paratrain.env.process import Dist  # noqa: E402
from paratrain.strategies.devices import DevicesOptions, DevicesStrategy  # noqa: E402

from benchmarks._lib.timing import abba, cpu_model, load, with_threads  # noqa: E402

warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates torch.jit.script/fork/wait


# --- (0) what runs at the same time, whatever the load ---------------------------------------------

MEET_TIMEOUT = 1.0


class Meet:
    """Two branches that each say they started, then wait (up to MEET_TIMEOUT s) for the other: both
    see the other only if they ran at the same time. Slow cores delay it, but cannot fake it."""

    def __init__(self) -> None:
        self.started = [threading.Event(), threading.Event()]
        self.met = [False, False]

    def arrive(self, i: int) -> None:
        self.started[i].set()
        self.met[i] = self.started[1 - i].wait(MEET_TIMEOUT)

    def branch(self, i: int) -> Callable[[Tensor], Tensor]:
        def fn(x: Tensor) -> Tensor:
            self.arrive(i)
            return x * 2
        return fn


@torch.jit.script
def spin_meet(mine: Tensor, other: Tensor) -> Tensor:
    """TorchScript's version: set ``mine``, spin (bounded) until ``other`` is set; 1 if it was."""
    mine.fill_(1)
    n = 0
    while bool(other[0] == 0) and n < 100000:
        n += 1
    return other.clone()


class Rendezvous(torch.autograd.Function):
    """Identity in forward; its backward meets the other branch's."""

    @staticmethod
    def forward(ctx, x: Tensor, meet: Meet, i: int) -> Tensor:  # type: ignore[override]
        ctx.meet, ctx.i = meet, i
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        ctx.meet.arrive(ctx.i)
        return g, None, None


def part_0() -> None:
    print("\n(0) do two branches run at the same time? (each waits for the other to start: load cannot fake it)")
    x = torch.ones(3)
    rows = []
    m = Meet()
    f = torch.jit.fork(m.branch(0), x)
    m.branch(1)(x)
    torch.jit.wait(f)
    rows.append(("torch.jit.fork(python function) from Python", all(m.met)))
    m = Meet()
    f = paratrain.fork(m.branch(0), x)
    m.branch(1)(x)
    paratrain.wait(f)
    rows.append(("paratrain.fork(python function): thread pool", all(m.met)))
    for name, forker, waiter in (("torch.jit.fork(scripted function) from Python", torch.jit.fork, torch.jit.wait),
                                 ("paratrain.fork(scripted function): TorchScript fork", paratrain.fork,
                                  paratrain.wait)):
        a, b = torch.zeros(1), torch.zeros(1)
        fut = forker(spin_meet, a, b)
        mine = spin_meet(b, a)
        rows.append((name, bool(waiter(fut)[0] == 1 and mine[0] == 1)))
    w = torch.ones(3, requires_grad=True)
    m = Meet()
    (Rendezvous.apply(w * 2, m, 0).sum() + Rendezvous.apply(w * 3, m, 1).sum()).backward()
    rows.append(("backward: one loss.backward() over two branches (CPU)", all(m.met)))
    m = Meet()
    outs = [Rendezvous.apply(w * 2, m, 0), Rendezvous.apply(w * 3, m, 1)]
    paratrain.fork_map(lambda t: torch.autograd.grad(t.sum(), w), outs)
    rows.append(("backward: autograd.grad per branch, in two threads", all(m.met)))
    for name, together in rows:
        print(f"  {name:55s} {'at the same time' if together else 'one after the other'}")


# --- (a) independent branches ------------------------------------------------------------------

@torch.jit.script
def compute(x: Tensor) -> Tensor:  # the seed's function
    return x * x


@torch.jit.script
def compute_heavy(x: Tensor) -> Tensor:  # a heavier variant: a matmul instead of an elementwise product
    return x @ x


def compute_eager(x: Tensor) -> Tensor:
    return x * x


def compute_heavy_eager(x: Tensor) -> Tensor:
    return x @ x


def seed_variants(scripted: torch.jit.ScriptFunction, eager: Callable[[Tensor], Tensor], a: Tensor, b: Tensor,
                  ) -> dict[str, Callable[[], object]]:
    def both_scripted(x: Tensor, y: Tensor) -> Tensor:
        f1 = torch.jit.fork(scripted, x)
        f2 = torch.jit.fork(scripted, y)
        return torch.jit.wait(f1) + torch.jit.wait(f2)

    def seq_scripted(x: Tensor, y: Tensor) -> Tensor:
        return scripted(x) + scripted(y)

    both_s, seq_s = torch.jit.script(both_scripted), torch.jit.script(seq_scripted)
    return {
        "sequential": lambda: eager(a) + eager(b),
        "eager jit.fork": lambda: torch.jit.wait(torch.jit.fork(eager, a)) + torch.jit.wait(torch.jit.fork(eager, b)),
        "paratrain.fork (threads)": lambda: paratrain.wait(paratrain.fork(eager, a)) + eager(b),
        "fork_map (threads)": lambda: sum(paratrain.fork_map(eager, [a, b])),
        "scripted sequential": lambda: seq_s(a, b),
        "scripted jit.fork": lambda: both_s(a, b),
        "fork_map scripted (jit launcher)": lambda: sum(paratrain.fork_map(scripted, [a, b])),
    }


SEED_BASE = {"eager jit.fork": "sequential", "paratrain.fork (threads)": "sequential",
             "fork_map (threads)": "sequential", "scripted jit.fork": "scripted sequential",
             "fork_map scripted (jit launcher)": "scripted sequential"}


def tower() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))


class TwoTower(nn.Module):
    """Two towers on the same input (or one input each), a linear head on both outputs."""

    def __init__(self, mode: str = "sequential") -> None:
        super().__init__()
        self.a, self.b = tower(), tower()
        self.head = nn.Linear(512, 10)
        self.mode = mode

    def forward(self, x: Tensor) -> Tensor:
        if self.mode == "eager jit.fork":
            fut = torch.jit.fork(self.a, x)
            hb = self.b(x)
            ha = torch.jit.wait(fut)
        elif self.mode == "fork_map":
            ha, hb = paratrain.fork_map([self.a, self.b], [x, x])
        else:
            ha, hb = self.a(x), self.b(x)
        return self.head(torch.cat([ha, hb], dim=1))


class ScriptedTwoTower(nn.Module):
    """The TorchScript way: the fork is inside the scripted forward."""

    def __init__(self, src: TwoTower, fork: bool) -> None:
        super().__init__()
        self.a, self.b, self.head = src.a, src.b, src.head
        self.fork = fork

    def forward(self, x: Tensor) -> Tensor:
        if self.fork:
            fut = torch.jit.fork(self.a, x)
            hb = self.b(x)
            ha = torch.jit.wait(fut)
        else:
            ha, hb = self.a(x), self.b(x)
        return self.head(torch.cat([ha, hb], dim=1))


class ForkMapScriptedTowers(nn.Module):
    def __init__(self, src: TwoTower) -> None:
        super().__init__()
        self.a, self.b = torch.jit.script(src.a), torch.jit.script(src.b)
        self.head = src.head

    def forward(self, x: Tensor) -> Tensor:
        ha, hb = paratrain.fork_map([self.a, self.b], [x, x])
        return self.head(torch.cat([ha, hb], dim=1))


def tower_models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    base = TwoTower()
    models: dict[str, nn.Module] = {}
    for mode in ("sequential", "eager jit.fork", "fork_map"):
        m = TwoTower(mode)
        m.load_state_dict(base.state_dict())
        models[mode] = m
    models["scripted sequential"] = torch.jit.script(ScriptedTwoTower(models["sequential"], fork=False))
    models["scripted jit.fork"] = torch.jit.script(ScriptedTwoTower(models["sequential"], fork=True))
    models["fork_map scripted (jit launcher)"] = ForkMapScriptedTowers(models["sequential"])
    return models


def train_step(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], object]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
    return step


def no_grad(fn: Callable[[Tensor], Tensor], x: Tensor) -> Callable[[], object]:
    def call() -> object:
        with torch.no_grad():
            return fn(x)
    return call


TOWER_BASE = {"eager jit.fork": "sequential", "fork_map": "sequential", "scripted jit.fork": "scripted sequential",
              "fork_map scripted (jit launcher)": "scripted sequential"}


def part_a(runs: int, reps: int) -> None:
    print("\n(a) independent branches, 1 intra-op thread per branch")
    s1, s2 = torch.tensor(10.0), torch.tensor(20.0)
    abba("seed: compute(x) = x * x on two scalars, forked twice", seed_variants(compute, compute_eager, s1, s2),
         SEED_BASE, runs, max(reps, 200))
    g = torch.Generator().manual_seed(0)
    m1, m2 = torch.randn(1024, 1024, generator=g) / 32, torch.randn(1024, 1024, generator=g) / 32
    abba("seed, heavier: compute(x) = x @ x on two 1024x1024 matrices",
         seed_variants(compute_heavy, compute_heavy_eager, m1, m2), SEED_BASE, runs, reps)
    models = tower_models()
    x = torch.randn(128, 512, generator=g)
    y = torch.randint(0, 10, (128,), generator=g)
    abba("two towers, forward (no_grad), batch 128", {n: no_grad(m, x) for n, m in models.items()},
         TOWER_BASE, runs, reps)
    abba("two towers, training step (forward + backward), batch 128",
         {n: train_step(m, x, y) for n, m in models.items()}, TOWER_BASE, runs, reps)


# --- (b) devices, pipelined ---------------------------------------------------------------------

def mlp(layers: int = 4, width: int = 1024) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, 10))
    return nn.Sequential(*mods)


def split(micro_batches: int, pipelined_backward: bool = True, sequential_chunks: bool = False) -> nn.Module:
    strategy = DevicesStrategy(Dist(ProcessInfo(), torch.device("cpu"), None),
                               options=DevicesOptions(devices=["cpu", "cpu"], split_points=["4"],
                                                      micro_batches=micro_batches))
    model = strategy.setup_model(mlp())
    model.pipelined_backward = pipelined_backward
    if sequential_chunks:
        model.forward = _sequential_chunks(model)  # type: ignore[method-assign]
    return model


def _sequential_chunks(model: nn.Module) -> Callable[[Tensor], Tensor]:
    """The same chunked, pipelined schedule with the ticks' tasks run one after another."""
    forward = model.forward

    def run(x: Tensor) -> Tensor:
        saved = devices_mod.fork_map
        devices_mod.fork_map = functools.partial(paratrain.fork_map, backend="sequential")
        try:
            return forward(x)
        finally:
            devices_mod.fork_map = saved
    return run


def devices_models() -> dict[str, nn.Module]:
    return {
        "micro_batches=1": split(1),
        "micro_batches=4 pipelined": split(4),
        "k=4, engine backward": split(4, pipelined_backward=False),
        "k=4, chunks one at a time": split(4, sequential_chunks=True),
    }


DEVICES_BASE = {n: "micro_batches=1" for n in devices_models()}


def part_b(runs: int, reps: int, batches: tuple[int, ...] = (1024, 256)) -> None:
    print("\n(b) devices on two CPU parts (4 x Linear(1024, 1024) + ReLU, then a Linear(1024, 10); cut after the "
          "second), 1 intra-op thread per part")
    g = torch.Generator().manual_seed(1)
    models = devices_models()
    for batch in batches:
        x = torch.randn(batch, 1024, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        abba(f"devices, training step (forward + backward), batch {batch} (micro-batches of {batch // 4})",
             {n: train_step(m, x, y) for n, m in models.items()}, DEVICES_BASE, runs, reps)
        if batch == batches[0]:
            fwd = {n: no_grad(m, x) for n, m in models.items()
                   if n in ("micro_batches=1", "micro_batches=4 pipelined", "k=4, chunks one at a time")}
            abba(f"devices, forward only (no_grad), batch {batch}", fwd, DEVICES_BASE, runs, reps)


# --- (c) intra-op threads instead ---------------------------------------------------------------

def part_c(runs: int, reps: int, batch: int = 1024) -> None:
    print("\n(c) the same shapes with intra-op threads: one branch at a time, 2 threads per kernel")
    g = torch.Generator().manual_seed(0)
    m1, m2 = torch.randn(1024, 1024, generator=g) / 32, torch.randn(1024, 1024, generator=g) / 32
    heavy = {"sequential, 1 thread": lambda: m1 @ m1 + m2 @ m2,
             "sequential, 2 intra-op threads": lambda: m1 @ m1 + m2 @ m2,
             "fork_map, 1 thread per branch": lambda: sum(paratrain.fork_map(compute_heavy_eager, [m1, m2]))}
    setups = {"sequential, 1 thread": with_threads(1), "sequential, 2 intra-op threads": with_threads(2),
              "fork_map, 1 thread per branch": with_threads(1)}
    base = {n: "sequential, 1 thread" for n in heavy}
    abba("seed, heavier: x @ x on two 1024x1024 matrices", heavy, base, runs, reps, dict(setups))
    models = tower_models()
    x = torch.randn(128, 512, generator=g)
    y = torch.randint(0, 10, (128,), generator=g)
    seq, fm = models["sequential"], models["fork_map"]
    abba("two towers, training step", {"sequential, 1 thread": train_step(seq, x, y),
                                       "sequential, 2 intra-op threads": train_step(seq, x, y),
                                       "fork_map, 1 thread per branch": train_step(fm, x, y)},
         base, runs, reps, dict(setups))
    xb = torch.randn(batch, 1024, generator=g)
    yb = torch.randint(0, 10, (batch,), generator=g)
    one, piped = split(1), split(4)
    abba(f"devices (two CPU parts), training step, batch {batch}",
         {"sequential, 1 thread": train_step(one, xb, yb), "sequential, 2 intra-op threads": train_step(one, xb, yb),
          "fork_map, 1 thread per branch": train_step(piped, xb, yb)},
         base, runs, reps, dict(setups))
    print("  (fork_map here = micro_batches=4 pipelined)")
    torch.set_num_threads(1)


SMOKE = {"runs": 1, "reps": 1, "batches": "256,64"}
"""``--smoke``: what CI runs (``tests/test_benchmarks.py``); flags given explicitly still win."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=6, help="ABBA runs per group (default 6; at least 5)")
    p.add_argument("--reps", type=int, default=5, help="calls per block (default 5)")
    p.add_argument("--only", choices=["0", "a", "b", "c"], help="one part only")
    p.add_argument("--batches", default="1024,256",
                   help="(b) and (c): batches of the devices split, each a multiple of 4 (default 1024,256)")
    p.add_argument("--smoke", action="store_true",
                   help=f"check that the benchmark runs, quickly ({SMOKE}); the numbers mean nothing")
    args = p.parse_args(argv)
    if args.smoke:
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        p.error(f"--batches {args.batches!r}: give comma-separated integers")
    if any(b < 4 or b % 4 for b in batches):
        p.error(f"--batches {args.batches}: each must be a positive multiple of 4 (micro_batches=4)")
    settings = paratrain.configure_threads(1, branches=2, verbose=False)
    print(f"hardware: {cpu_model()}, {settings.cores} usable cores; torch {torch.__version__}; "
          f"python {platform.python_version()}")
    print(f"threads: {torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op "
          f"(paratrain.configure_threads(1, branches=2)); {args.runs} ABBA runs x {args.reps} calls per variant")
    print(f"load average (1/5/15 min) before: {load()}   -- a shared machine: other jobs take cores too")
    t0 = time.perf_counter()
    if args.only in (None, "0"):
        part_0()
    parts: dict[str, Callable[[], None]] = {"a": lambda: part_a(args.runs, args.reps),
                                            "b": lambda: part_b(args.runs, args.reps, batches),
                                            "c": lambda: part_c(args.runs, args.reps, batches[0])}
    for name, part in parts.items():
        if args.only in (None, name):
            part()
    print(f"\nload average after: {load()}; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
