"""Parity with plain PyTorch: the problems, models and one-process reference loop that every
equivalence test (ddp, syncbn, fsdp, tensor, pipeline, devices, ps, precision) compares against.

An equivalence test asserts that paratrain at N processes ends where a plain loop ends, to a
relative tolerance. That only tests paratrain if the *problem* is well conditioned: two float32
computations of the same training that differ only in rounding (another summation order, another
thread count, gradients summed over ranks instead of over one batch) must end far inside the
tolerance. Random labels, a large learning rate with heavy momentum and BatchNorm amplify a
1e-7 rounding difference into 1e-3 within a few dozen steps; the test then measures chaos.
So the problems here are

* learnable: labels come from a fixed random linear teacher on the inputs, so gradients shrink
  smoothly as the model learns instead of pushing a memorising model around;
* smooth: Tanh, not ReLU, in the models here (a ReLU input within rounding of 0 is a jump);
* gentle: moderate learning rates and momentum, few steps (each test's :class:`Problem`);
* checked: ``tests/test_parity_conditioning.py`` trains every float32 reference with 1 and 2
  intra-op threads and against float64, and asserts the gaps are >= 10x inside the tolerance the
  test uses.

The core cases (ddp, SyncBatchNorm, accumulation) also run the same problem in float64
(``dtype=torch.float64``) at ``FLOAT64_RTOL``: rounding stays below 1e-12 there, while training on
another sample order, or with BatchNorm statistics of half a batch (no SyncBatchNorm), moves the
weights by more than 1e-3 (shown by ``tests/test_invariance.py``).

The reference takes its sample order from paratrain's public ``epoch_permutation`` (the one
documented contract between the two); everything else is plain ``torch``. The paratrain half is
:func:`run_paratrain` (one process) and :func:`run_workers` (N processes over gloo): a strategy's
test compares what they return with ``problem.reference()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.data.sampler import epoch_permutation

# float64 rounding after a few dozen steps of these problems is <= 1e-14 (paratrain vs reference and
# 1 vs 2 threads, measured); a real difference in what is trained (order, reduction, synchronisation)
# is >= 1e-3. 1e-10 sits in between, with 4 and 7 orders of magnitude on either side.
FLOAT64_RTOL = 1e-10


# --- data -------------------------------------------------------------------------------------
def teacher_data(n: int, shape: tuple[int, ...] = (12,), classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` float32 inputs of ``shape`` (drawn from ``seed``) and the labels a fixed random
    linear teacher gives them.

    The labels are a function of the inputs (``argmax(x @ W)``), so a model can learn them and
    the training trajectory is smooth. ``W`` depends on ``shape`` and ``classes`` only, so sets
    drawn with other seeds (an evaluation set) follow the same rule. Float64 runs cast these values.
    """
    x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))
    teacher = torch.randn(math.prod(shape), classes, generator=torch.Generator().manual_seed(20240))
    # float64 logits: a near-tie cannot flip a label between CPUs or BLAS builds
    return x, (x.flatten(1).double() @ teacher.double()).argmax(1)


# --- models -----------------------------------------------------------------------------------
def mlp(*widths: int, acts: Any = nn.Tanh, flatten: bool = False) -> nn.Sequential:
    """``Linear`` layers of the given widths with an activation between each pair.

    ``acts`` is one activation class, or one per gap (``(nn.Tanh, nn.GELU)``). The default is
    smooth on purpose: a ReLU unit whose input lands within rounding of 0 switches its gradient on
    or off, a jump that one float32-vs-float64 run turned into a 4e-5 weight difference after 24
    steps. ``flatten`` puts an ``nn.Flatten`` first (image-shaped inputs); layer indices are those
    of the plain Sequential.
    """
    gaps = len(widths) - 2
    acts = list(acts) if isinstance(acts, (list, tuple)) else [acts] * gaps
    assert len(acts) == gaps, f"{gaps} activations needed, got {len(acts)}"
    layers: list[nn.Module] = [nn.Flatten()] if flatten else []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < gaps:
            layers.append(acts[i]())
    return nn.Sequential(*layers)


def cnn(channels: int = 1, size: int = 6, width: int = 4, classes: int = 4) -> nn.Sequential:
    """Two Conv-BatchNorm-Tanh blocks over ``(channels, size, size)`` images and a linear head on
    the flattened features (a global pool could not express the linear teacher: it would not learn)."""
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.Tanh(),
        nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.Tanh(),
        nn.Flatten(), nn.Linear(width * size * size, classes),
    )


class Block(nn.Module):
    """Pre-norm MLP block of a transformer: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, d: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Stack(nn.Module):
    """A small transformer-ish stack over sequences (N, T, 12): embed, 2 blocks, mean-pool, head."""

    def __init__(self, features: int = 12, d: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(features, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)).mean(1))


# --- the problem and its reference --------------------------------------------------------------
@dataclass(frozen=True)
class Trained:
    """What the reference loop ends with."""

    state: dict[str, torch.Tensor]  # the model's state_dict (cloned)
    losses: list[float]  # the loss of each optimizer step (mean over its micro-batches)
    model: nn.Module


@dataclass(frozen=True)
class Problem:
    """One equivalence problem: what is trained, how, and the float32 tolerance its tests assert.

    The paratrain side builds the same things from it: ``Parallel(global_batch=p.global_batch,
    seed=p.seed, ...)``, ``p.model()``, ``p.optimizer(params)``, ``TensorDataset(*p.data())``.
    Picklable (module-level callables, ``functools.partial``), so it can be handed to workers.
    """

    make_model: Callable[[], nn.Module]
    make_data: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # float32 inputs, integer labels
    global_batch: int
    steps: int
    seed: int
    lr: float
    rtol: float  # relative error the float32 tests allow; >= 10x the measured conditioning gaps
    momentum: float = 0.0
    accumulation: int = 1
    clip: float | None = None  # max global gradient norm (clip_grad_norm_), after accumulation
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None  # stepped after every optimizer step
    dtype: torch.dtype = torch.float32

    def replace(self, **changes: Any) -> "Problem":
        return dataclasses.replace(self, **changes)

    def model(self) -> nn.Module:
        """A fresh model in the problem's dtype (seed torch first for the reference's weights)."""
        return self.make_model().to(self.dtype)

    def data(self) -> tuple[torch.Tensor, ...]:
        """The data set, floating tensors in the problem's dtype (float64 casts the float32 values)."""
        return tuple(t.to(self.dtype) if t.is_floating_point() else t for t in self.make_data())

    def optimizer(self, params: Any) -> torch.optim.SGD:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)

    def reference(self, order: Callable[[int, int, int], torch.Tensor] = epoch_permutation) -> Trained:
        return reference(self, order)


def global_batches(n: int, global_batch: int, seed: int, steps: int,
                   order: Callable[[int, int, int], torch.Tensor] = epoch_permutation) -> Iterator[torch.Tensor]:
    """The sample indices of each of ``steps`` optimizer steps, in paratrain's documented order:
    epoch ``e`` is ``epoch_permutation(n, seed, e)``, step ``s`` of it takes positions
    ``[s*B, (s+1)*B)``, and the ``n mod B`` tail is dropped."""
    per_epoch = n // global_batch
    perm = None
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        if s == 0 or perm is None:
            perm = order(n, seed, epoch)
        yield perm[s * global_batch:(s + 1) * global_batch]


def reference(problem: Problem, order: Callable[[int, int, int], torch.Tensor] = epoch_permutation,
              loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy) -> Trained:
    """Plain PyTorch, one process: the loop the user had before paratrain.

    Each optimizer step takes the next global batch, splits it into ``accumulation`` contiguous
    micro-batches (what paratrain's micro-steps see, so BatchNorm statistics match), sums their
    ``loss / accumulation`` gradients, clips the global norm, steps SGD, then the scheduler.
    ``order`` replaces the epoch order (the negative checks use another seed).
    """
    p = problem
    x, y = p.data()
    torch.manual_seed(p.seed)
    model = p.model()
    opt = p.optimizer(model.parameters())
    sched = p.scheduler(opt) if p.scheduler is not None else None
    micro = p.global_batch // p.accumulation
    losses = []
    for idx in global_batches(len(x), p.global_batch, p.seed, p.steps, order):
        opt.zero_grad()
        step_loss = 0.0
        for a in range(p.accumulation):
            i = idx[a * micro:(a + 1) * micro]
            loss = loss_fn(model(x[i]), y[i])
            (loss / p.accumulation).backward()
            step_loss += loss.item() / p.accumulation
        if p.clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), p.clip)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(step_loss)
    return Trained({k: v.detach().clone() for k, v in model.state_dict().items()}, losses, model)


# --- comparing -----------------------------------------------------------------------------------
def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``|got - ref| / |ref|`` (Frobenius norms, in float64; absolute where ``ref`` is zero)."""
    got, ref = got.detach().double(), ref.detach().double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def state_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest :func:`relative_error` over the floating tensors of two state dicts."""
    return max((relative_error(got[k], v) for k, v in ref.items() if v.is_floating_point()), default=0.0)


def assert_same_state(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rtol: float) -> float:
    """The same keys, dtypes and integer buffers; every floating tensor within ``rtol`` relative
    error (per tensor, Frobenius norm). Returns the largest relative error seen."""
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    worst = 0.0
    for k, want in ref.items():
        have = got[k]
        assert have.dtype == want.dtype, f"{k}: dtype {have.dtype}, expected {want.dtype}"
        if want.is_floating_point():
            err = relative_error(have, want)
            assert err <= rtol, f"{k}: relative error {err:.2e} > {rtol}"
            worst = max(worst, err)
        else:
            assert torch.equal(have, want), k
    return worst


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- the paratrain half ---------------------------------------------------------------------------
def run_paratrain(problem: Problem, strategy: str = "single", *, before: Callable[..., Any] | None = None,
                  after: Callable[..., dict[str, Any]] | None = None, loader_options: dict[str, Any] | None = None,
                  loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy, **parallel: Any) -> dict[str, Any]:
    """The paratrain half of a parity run, in this process: what a user's loop does with
    ``Parallel(strategy=..., global_batch, seed, accumulation and clip of the problem, **parallel)``
    (``parallel`` wins: ``micro_batch=8`` instead of the accumulation, more accumulation than the
    reference's where the sum is the same).

    The problem's model and optimizer are set up (its scheduler registered: stepped after every
    optimizer step, as the reference steps it), ``before(pt, model, optimizer)`` runs (assertions about
    the wrapping), then ``problem.steps`` optimizer steps over ``pt.train_loader`` of the problem's data
    with ``pt.training_step`` (forward, loss and backward as the strategy runs them). Returns the whole
    trained state (``pt.full_state_dict``: unsharded, every pipeline stage, CPU tensors, the user's
    keys), the loss of each step (the mean over its micro-batches, as :func:`reference` reports it),
    this rank's first micro-batch of inputs, and what ``after(pt, model, optimizer)`` adds. The process
    group stays: a worker may train several runs, then ``paratrain.destroy()``.
    """
    parallel = {"accumulation": problem.accumulation if problem.accumulation > 1 else None,
                "clip_grad_norm": problem.clip, **parallel}
    pt = paratrain.Parallel(strategy=strategy, global_batch=problem.global_batch, seed=problem.seed, **parallel)
    model = problem.model()
    model, optimizer = pt.setup(model, problem.optimizer(model.parameters()))
    if problem.scheduler is not None:
        pt.register_scheduler(problem.scheduler(optimizer))
    if before is not None:
        before(pt, model, optimizer)
    loader = pt.train_loader(TensorDataset(*problem.data()), **(loader_options or {}))  # DataLoader settings
    losses, step_loss, first = [], 0.0, None
    while pt.global_step < problem.steps:
        for batch in loader:
            first = batch[0].clone() if first is None else first
            optimizer.zero_grad()
            step_loss += pt.training_step(model, batch, loss_fn).item() / pt.accumulation
            optimizer.step()
            if pt.micro_step == 0:  # a global batch ended
                losses.append(step_loss)
                step_loss = 0.0
                if pt.global_step == problem.steps:
                    break
    out = {"state": pt.full_state_dict(model), "losses": losses, "first_inputs": first}
    return {**out, **(after(pt, model, optimizer) if after is not None else {})}


def run_workers(world: int, *runs: tuple[Any, ...], timeout: float = 90) -> list[list[dict[str, Any]]]:
    """Each of ``runs`` (``(problem, strategy)`` or ``(problem, strategy, {Parallel options, before=, after=})``)
    by :func:`run_paratrain`, one after the other in one launch of ``world`` processes over gloo
    (starting processes is the slow part); returns every rank's list of results."""
    return paratrain.launch(_paratrain_worker, nprocs=world, args=(runs,), timeout=timeout)


def _paratrain_worker(local_rank: int, runs: tuple[tuple[Any, ...], ...]) -> list[dict[str, Any]]:
    out = [run_paratrain(problem, strategy, **(options[0] if options else {})) for problem, strategy, *options in runs]
    paratrain.destroy(wait_for_peers=True)  # as pt.close(): collectives done
    return out
