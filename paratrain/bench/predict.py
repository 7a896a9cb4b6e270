"""Scaling predictor: step time at N workers = measured compute + exposed communication.

The model (weak scaling: each worker keeps the measured per-worker batch):

* **compute** ``t_c``: the measured step time of one worker (``single`` in the bench table);
* **a collective** over ``N`` workers on a link of latency ``α`` and bandwidth ``β`` (bytes/s), as
  a ring: all-reduce of ``S`` bytes takes ``2(N−1)α + 2(N−1)/N · S/β``; all-gather and
  reduce-scatter (the output's ``S`` bytes) take half: ``(N−1)α + (N−1)/N · S/β``. A bucket of
  gradients (DDP's 25 MiB) is one collective, so the latency term is paid per bucket;
* **what is sent per step**, with ``P`` parameters:
  ``all-reduce (ddp)`` all-reduces ``4P`` bytes (fp32 gradients); ``fp16 all-reduce`` (ddp's fp16
  comm hook) ``2P``; ``PowerSGD all-reduce`` (rank ``r``) all-reduces ``r(m+n)`` floats for ``P`` and ``Q`` of each weight viewed as an ``m×n``
  matrix (two collectives per bucket) and the 1-D tensors whole; ``sharded (fsdp)`` (full sharding)
  all-gathers ``4P`` in the forward, again in the backward, and reduce-scatters ``4P`` gradients;
* **overlap**: only the fraction ``exposed`` of the communication adds to the step (DDP overlaps
  bucket all-reduces with the backward; 1 = none hidden). It is measured from the bench's 2-worker
  ``ddp`` cell, or given.

* **nodes** (:class:`Nodes`, optional): ``G`` workers per node joined by a faster link (NVLink,
  PCIe) and the nodes by the network link. A collective then runs in two levels, as NCCL's and
  Horovod's hierarchical all-reduce do: an all-reduce is a reduce-scatter inside each node, an
  all-reduce across the ``n = N/G`` nodes (the node's ``G`` rings share its network link, so the
  network carries ``2(n−1)/n · S`` per node, and pays ``2(n−1)α``, not ``2(N−1)α``), then an
  all-gather inside the node; an all-gather or reduce-scatter is one level of each. Without it
  every hop is a network hop.

``samples/s = N·b / (t_c + exposed · t_comm(N))`` and ``efficiency = t_c / (t_c + exposed · t_comm(N))``.
Not modelled: the compression's own compute, stragglers, congestion, tree all-reduce (NCCL switches
to it at scale, which makes the latency term ``log N`` rather than ``N``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Link", "Nodes", "Workload", "Prediction", "ring_all_reduce_s", "ring_gather_s", "all_reduce_s", "gather_s",
           "scheme_comm_s", "predict", "fit_link", "format_predictions", "SCHEMES", "DEFAULT_WORKERS", "BUCKET_BYTES"]

BUCKET_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb``."""
SCHEMES = ("all-reduce (ddp)", "fp16 all-reduce", "PowerSGD all-reduce", "sharded (fsdp)")
DEFAULT_WORKERS = tuple(2**k for k in range(1, 11))  # 2 … 1024

_BANDWIDTH = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
              "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_LATENCY = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class Link:
    """A network link: per-message ``latency_s`` and ``bandwidth`` in bytes/s."""

    latency_s: float
    bandwidth: float
    source: str = "given"

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth <= 0:
            raise ValueError(f"a link needs latency >= 0 and bandwidth > 0, got {self.latency_s} s, {self.bandwidth} B/s")

    @classmethod
    def parse(cls, text: str, flag: str = "--link") -> "Link":
        """``"100gbit,5us"`` (either order; bandwidth in bit/kbit/mbit/gbit/tbit (or gbps...) or
        b/kb/mb/gb/tb (bytes) per second, latency in s/ms/us/ns)."""
        bandwidth = latency = None
        for part in (re.sub(r"bps$", "bit", p.strip().lower().removesuffix("/s")) for p in text.split(",")):
            m = re.fullmatch(r"([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]+)", part)
            if m and m.group(2) in _LATENCY and latency is None:
                latency = float(m.group(1)) * _LATENCY[m.group(2)]
            elif m and m.group(2) in _BANDWIDTH and bandwidth is None:
                bandwidth = float(m.group(1)) * _BANDWIDTH[m.group(2)]
            else:
                raise ValueError(f"{flag} {text!r}: {part!r} is neither a bandwidth (e.g. 100gbit) nor a latency "
                                 "(e.g. 5us); write it as 100gbit,5us")
        if bandwidth is None or latency is None:
            raise ValueError(f"{flag} {text!r} needs a bandwidth and a latency, e.g. 100gbit,5us")
        return cls(latency, bandwidth, f"{flag} {text}")

    def describe(self) -> str:
        return f"{self.bandwidth * 8 / 1e9:.3g} Gbit/s, {self.latency_s * 1e6:.3g} µs ({self.source})"


@dataclass(frozen=True)
class Nodes:
    """``per_node`` workers to a node, joined by ``link`` (NVLink, PCIe); nodes by the network."""

    per_node: int
    link: Link

    def __post_init__(self) -> None:
        if self.per_node < 1:
            raise ValueError(f"--workers-per-node {self.per_node} must be at least 1")

    def split(self, workers: int) -> tuple[int, int]:
        """``(workers in a node, nodes)`` for ``workers`` in all, nodes filled first."""
        return min(self.per_node, workers), math.ceil(workers / self.per_node)

    def describe(self) -> str:
        return f"{self.per_node} workers per node joined by {self.link.describe()}"


@dataclass(frozen=True)
class Workload:
    """What one worker computes and what its gradients are."""

    compute_s: float
    """Measured step time of one worker at ``batch_per_worker``."""
    batch_per_worker: int
    shapes: tuple[tuple[int, ...], ...]
    """The shapes of the trainable parameters (PowerSGD's bytes depend on them)."""
    exposed: float = 1.0
    """Fraction of the communication not hidden behind compute (0–1)."""
    powersgd_rank: int = 1
    bucket_bytes: int = BUCKET_BYTES
    together: tuple[tuple[int, float], ...] = ()
    """``(N, seconds)``: one worker's compute while N processes run it at once on one host (its cores and
    memory shared), for the worker counts where it was measured; elsewhere ``compute_s``. On 16 cores
    resnet8's step took 1.18x as long with 4 at once and 1.67x with 8 (docs/predict.md)."""

    def __post_init__(self) -> None:
        if self.compute_s <= 0 or self.batch_per_worker < 1:
            raise ValueError(f"compute {self.compute_s} s and batch {self.batch_per_worker} must be positive")
        if not 0 <= self.exposed <= 1:
            raise ValueError(f"exposed fraction {self.exposed} must be between 0 and 1")
        if any(n < 1 or t <= 0 for n, t in self.together):
            raise ValueError(f"together {self.together}: each (workers, seconds) must be positive")

    def compute_at(self, workers: int) -> float:
        """One worker's compute at ``workers``: measured with that many at once, else ``compute_s``."""
        return dict(self.together).get(workers, self.compute_s)

    @classmethod
    def from_params(cls, params: int, compute_s: float, batch_per_worker: int, exposed: float = 1.0) -> "Workload":
        """A model known only by its parameter count (as one flat 1-D tensor: no PowerSGD estimate)."""
        return cls(compute_s, batch_per_worker, ((params,),), exposed)

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def buckets(self, nbytes: float) -> int:
        return max(1, math.ceil(nbytes / self.bucket_bytes))

    def powersgd_floats(self) -> int:
        """Floats all-reduced per step: ``r(m+n)`` per matrix (P and Q), 1-D tensors whole."""
        total = 0
        for s in self.shapes:
            if len(s) < 2:
                total += math.prod(s)
            else:
                m, n = s[0], math.prod(s[1:])
                total += min(self.powersgd_rank * (m + n), m * n)  # never more than the plain gradient
        return total


def ring_all_reduce_s(nbytes: float, workers: int, link: Link) -> float:
    """One ring all-reduce of ``nbytes``: ``2(N−1)α + 2(N−1)/N · S/β`` (0 for one worker)."""
    if workers < 2:
        return 0.0
    n = workers
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bandwidth


def ring_gather_s(nbytes: float, workers: int, link: Link) -> float:
    """One ring all-gather (or reduce-scatter) of ``nbytes`` in all: ``(N−1)α + (N−1)/N · S/β``."""
    if workers < 2:
        return 0.0
    n = workers
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bandwidth


def all_reduce_s(nbytes: float, workers: int, link: Link, nodes: Nodes | None = None) -> float:
    """One all-reduce of ``nbytes``: a ring over ``link``, or in two levels over ``nodes``:
    reduce-scatter in the node, all-reduce across nodes, all-gather in the node."""
    if nodes is None:
        return ring_all_reduce_s(nbytes, workers, link)
    g, n = nodes.split(workers)
    return 2 * ring_gather_s(nbytes, g, nodes.link) + ring_all_reduce_s(nbytes, n, link)


def gather_s(nbytes: float, workers: int, link: Link, nodes: Nodes | None = None) -> float:
    """One all-gather (or reduce-scatter) of ``nbytes``: a ring over ``link``, or one level in the
    node and one across nodes."""
    if nodes is None:
        return ring_gather_s(nbytes, workers, link)
    g, n = nodes.split(workers)
    return ring_gather_s(nbytes, g, nodes.link) + ring_gather_s(nbytes, n, link)


def _bucketed(collective: str, nbytes: float, buckets: int, workers: int, link: Link, nodes: Nodes | None) -> float:
    one = all_reduce_s if collective == "all_reduce" else gather_s
    return buckets * one(nbytes / buckets, workers, link, nodes)


def scheme_comm_s(scheme: str, w: Workload, workers: int, link: Link, nodes: Nodes | None = None) -> float:
    """Seconds of communication per step of ``scheme`` (before overlap)."""
    grad = 4.0 * w.params
    if scheme == "all-reduce (ddp)":
        return _bucketed("all_reduce", grad, w.buckets(grad), workers, link, nodes)
    if scheme == "fp16 all-reduce":
        return _bucketed("all_reduce", grad / 2, w.buckets(grad), workers, link, nodes)
    if scheme == "PowerSGD all-reduce":  # P then Q: two all-reduces per bucket
        return _bucketed("all_reduce", 4.0 * w.powersgd_floats(), 2 * w.buckets(grad), workers, link, nodes)
    if scheme == "sharded (fsdp)":  # all-gather (forward), all-gather (backward), reduce-scatter (gradients)
        return 3 * _bucketed("gather", grad, w.buckets(grad), workers, link, nodes)
    raise ValueError(f"scheme {scheme!r} is unknown: use one of {', '.join(SCHEMES)}")


@dataclass(frozen=True)
class Prediction:
    scheme: str
    workers: int
    step_s: float
    comm_s: float
    """Communication before overlap; ``exposed`` times it adds to the step."""
    samples_per_s: float
    efficiency: float


def predict(w: Workload, link: Link, schemes: Sequence[str] = SCHEMES,
            workers: Sequence[int] = DEFAULT_WORKERS, nodes: Nodes | None = None) -> list[Prediction]:
    out = []
    for scheme in schemes:
        for n in workers:
            comm = scheme_comm_s(scheme, w, n, link, nodes)
            step = w.compute_at(n) + w.exposed * comm
            out.append(Prediction(scheme, n, step, comm, n * w.batch_per_worker / step, w.compute_s / step))
    return out


def fit_link(samples: Sequence[tuple[float, float]], workers: int = 2, source: str = "fitted") -> Link:
    """Latency and bandwidth from ``(bytes, seconds)`` of all-reduces over ``workers``: least squares
    of ``t = 2(N−1)α + 2(N−1)/N · S/β`` in relative error (weights ``1/t²``), so that the small
    messages, which carry the latency, count as much as the large ones."""
    if len({s for s, _ in samples}) < 2:
        raise ValueError("fitting a link needs all-reduces of at least two sizes")
    ws = [1 / t**2 for _, t in samples]
    sw = sum(ws)
    mx = sum(w * s for w, (s, _) in zip(ws, samples)) / sw
    mt = sum(w * t for w, (_, t) in zip(ws, samples)) / sw
    slope = (sum(w * (s - mx) * (t - mt) for w, (s, t) in zip(ws, samples))
             / sum(w * (s - mx) ** 2 for w, (s, _) in zip(ws, samples)))
    intercept = mt - slope * mx
    if slope <= 0:
        raise ValueError("all-reduce time does not grow with size: the measurement is noise")
    n = workers
    return Link(max(intercept, 0.0) / (2 * (n - 1)), 2 * (n - 1) / n / slope, source)


def format_predictions(w: Workload, link: Link, preds: Sequence[Prediction], nodes: Nodes | None = None) -> str:
    """A table: one row per worker count, samples/s and efficiency per scheme."""
    schemes = list(dict.fromkeys(p.scheme for p in preds))
    by = {(p.scheme, p.workers): p for p in preds}
    workers = sorted({p.workers for p in preds})
    head = f"{'workers':>7} | " + " | ".join(f"{s:>22}" for s in schemes)
    lines = [
        f"predicted scaling (weak: {w.batch_per_worker} samples per worker per step; compute {w.compute_s * 1e3:.3g} ms "
        f"a step; {w.params:,} parameters; {w.exposed:.0%} of communication exposed)",
        f"link: {link.describe()}" + (f"; {nodes.describe()}" if nodes else ""),
        head, "-" * len(head),
    ]
    for n in workers:
        cells = [by[(s, n)] for s in schemes]
        lines.append(f"{n:>7} | " + " | ".join(f"{_rate(p.samples_per_s):>12}/s {p.efficiency:>7.1%}" for p in cells))
    return "\n".join(lines)


def _rate(v: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.3g}"
