"""Choose the layout: every mesh of a world that fits each device's memory, with its predicted step time.

For ``N`` workers on ``K`` nodes (``G = N/K`` to a node), every ``pp x dp_replicate x dp_shard x tp``
whose sizes multiply to ``N`` is a candidate, but ``tp`` must divide ``G`` (a tensor-parallel group
stays in one node: its collectives run once per block) and ``pp`` cannot exceed the model's blocks.
Each gets each rank's peak memory (:func:`paratrain.bench.memory.estimate` with ``mesh``) and a
predicted step, the terms of :mod:`paratrain.bench.predict` per dimension:

* **compute**: the model's forward FLOPs (counted on the meta device) times 3 (forward and
  backward) for the ``b`` samples a replica's step takes, at ``--device-tflops`` (what the device
  achieves, not its peak), over the ``pp x tp`` ranks that share a replica's work; the pipeline's
  bubble adds ``(pp − 1)/m`` of it (GPipe and 1F1B alike, ``m`` micro-batches);
* **dp_shard** (FSDP2): all-gather of the rank's stage (its ``tp`` slice) in the forward and again in
  the backward, reduce-scatter of its gradients: ``3 ×`` a ring gather of ``4 S_tp`` bytes;
* **dp_replicate**: all-reduce of the gradient shard, ``4 S_tp / dp_shard`` bytes;
* **tp**: two all-reduces in the forward and two in the backward per block, of the block's input
  (``b`` samples);
* **pp**: one send per stage boundary of a micro-batch's block input, forward and backward, on the
  critical path of the fill and the drain.

A dimension's group is inside a node when its ranks are (``tp`` innermost, then ``dp_shard``,
``dp_replicate``, ``pp``: the mesh's order, :mod:`paratrain.strategies.mesh`), over ``--node-link``;
across nodes over ``--link``, two-level where it spans both. No overlap is assumed (an upper bound;
DDP and FSDP hide part of theirs behind the backward). Layouts that fit come first, by predicted
throughput (samples per second: each data-parallel rank's ``b`` samples over the step), highest first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .memory import Estimate, ModelFacts, estimate
from .predict import Link, Nodes, all_reduce_s, gather_s

__all__ = ["LayoutChoice", "candidate_layouts", "choose_layouts", "format_choices"]


@dataclass(frozen=True)
class LayoutChoice:
    """One layout: its sizes, each rank's memory estimate and the predicted step's parts (seconds)."""

    sizes: dict[str, int]
    estimate: Estimate
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]
    fits: bool

    @property
    def name(self) -> str:
        from ..strategies.mesh import describe

        return describe(self.sizes)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + sum(self.comm_s.values())

    def samples_per_s(self, batch: int) -> float:
        """The job's throughput: ``batch`` samples per data-parallel rank (``dp_replicate x dp_shard``) a step."""
        return self.sizes["dp_replicate"] * self.sizes["dp_shard"] * batch / self.step_s


def candidate_layouts(world: int, per_node: int, max_stages: int) -> list[dict[str, int]]:
    """Every ``{pp, dp_replicate, dp_shard, tp}`` making ``world``, ``tp`` dividing ``per_node``, ``pp <= max_stages``."""
    from ..strategies.mesh import DIMS

    out = []
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for pp in divisors:
        for tp in divisors:
            if pp > max(1, max_stages) or per_node % tp or world % (pp * tp):
                continue
            rest = world // (pp * tp)
            for rep in (d for d in divisors if rest % d == 0):
                out.append(dict(zip(DIMS, (pp, rep, rest // rep, tp))))
    return out


def _group_link(sizes: dict[str, int], dim: str, per_node: int, link: Link, node_link: Link) -> tuple[Link, Nodes | None]:
    """The link a dimension's collectives run over: ``node_link`` when its group is inside a node,
    ``link`` when every member is on another node, both (two levels) otherwise."""
    from ..strategies.mesh import DIMS

    stride = math.prod(sizes[d] for d in DIMS[DIMS.index(dim) + 1:])
    if stride * sizes[dim] <= per_node:
        return node_link, None
    if stride >= per_node:
        return link, None
    return link, Nodes(per_node // stride, node_link)


def _predict(facts: ModelFacts, sizes: dict[str, int], batch: int, n_micro: int, flops: float, per_node: int,
             link: Link, node_link: Link) -> tuple[float, float, dict[str, float]]:
    """``(compute, bubble, {dimension: communication})`` seconds of one step of ``sizes``."""
    pp, rep, shard, tp = (sizes[d] for d in ("pp", "dp_replicate", "dp_shard", "tp"))
    stage = facts.stage(pp)
    share = stage / facts.params if facts.params else 1.0
    compute = 3 * facts.forward_flops * batch * share / tp / flops
    m = max(1, min(n_micro, batch)) if pp > 1 else 1
    bubble = compute * (pp - 1) / m
    linear = facts.linear_params * share
    stage_bytes = 4 * (stage - linear + linear / tp)  # fp32: the rank's tp slice of its stage, before sharding
    blocks = max(1, round(facts.blocks * share)) if facts.blocks else 1
    block_input = facts.block_input_bytes / max(1, facts.blocks) * batch  # one block's input for the step's samples
    comm: dict[str, float] = {}
    if shard > 1:
        comm["dp_shard"] = 3 * gather_s(stage_bytes, shard, *_group_link(sizes, "dp_shard", per_node, link, node_link))
    if rep > 1:
        comm["dp_replicate"] = all_reduce_s(stage_bytes / shard, rep,
                                            *_group_link(sizes, "dp_replicate", per_node, link, node_link))
    if tp > 1:
        comm["tp"] = 4 * blocks * all_reduce_s(block_input, tp, *_group_link(sizes, "tp", per_node, link, node_link))
    if pp > 1:
        hop, _ = _group_link(sizes, "pp", per_node, link, node_link)
        comm["pp"] = 2 * (pp - 1) * (hop.latency_s + block_input / m / hop.bandwidth)
    return compute, bubble, comm


def choose_layouts(facts: ModelFacts, world: int, nodes: int, batch: int, device_memory: float,
                   precision: str | None = None, optimizer: str = "adamw", n_micro: int = 4,
                   tflops: float = 100.0, link: Link | None = None, node_link: Link | None = None,
                   device: str = "cuda", sharded_init: bool = True, checkpointing: bool = False) -> list[LayoutChoice]:
    """Every candidate layout of ``world`` workers on ``nodes`` nodes for ``batch`` samples per
    data-parallel rank and step: the ones whose peak fits ``device_memory`` bytes first, each group
    by its predicted throughput (samples per second: the data-parallel ranks' samples over the
    predicted step, :func:`_predict`), highest first."""
    if world < 1 or nodes < 1 or world % nodes:
        raise ValueError(f"--world {world} on --nodes {nodes}: the nodes must hold the same number of workers "
                         f"(use a world that is a multiple of {nodes})")
    if tflops <= 0 or batch < 1:
        raise ValueError(f"--device-tflops {tflops} and --micro-batch {batch} must be positive")
    per_node = world // nodes
    link = link or Link(5e-6, 100e9 / 8, "100 Gbit/s, 5 µs (default)")
    node_link = node_link or Link(2e-6, 300e9, "300 GB/s, 2 µs (default)")
    choices = []
    for sizes in candidate_layouts(world, per_node, max(facts.blocks, 1)):
        try:
            est = estimate(facts, "mesh", world, batch, precision, optimizer, checkpointing, sharded_init=sharded_init,
                           device=device, mesh=sizes)
        except ValueError:  # a pipeline depth the model was not cut for
            continue
        compute, bubble, comm = _predict(facts, sizes, batch, n_micro, tflops * 1e12, per_node, link, node_link)
        choices.append(LayoutChoice(sizes, est, compute, bubble, comm, est.peak <= device_memory))
    choices.sort(key=lambda c: (not c.fits, -c.samples_per_s(batch), c.estimate.peak))
    return choices


def format_choices(choices: Sequence[LayoutChoice], title: str, batch: int, limit: int = 12) -> str:
    """The table: layout, each rank's peak, the predicted throughput, step and its parts; what does not fit after."""
    def ms(s: float) -> str:
        return f"{s * 1e3:,.1f}"

    head = ("layout", "fits", "peak GiB per rank", "samples/s", "step ms", "compute", "bubble",
            "communication by dimension (ms)")
    rows = []
    for c in list(choices)[:limit]:
        comm = ", ".join(f"{d} {ms(s)}" for d, s in c.comm_s.items()) or "-"
        rows.append((c.name, "yes" if c.fits else "no", f"{c.estimate.peak / 2**30:,.2f}",
                     f"{c.samples_per_s(batch):,.0f}", ms(c.step_s), ms(c.compute_s), ms(c.bubble_s), comm))
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    fitting = sum(c.fits for c in choices)
    more = f"; {len(choices) - limit} more not shown" if len(choices) > limit else ""
    return "\n".join([title, *(fmt.format(*r).rstrip() for r in (head, *rows)),
                      f"{fitting} of {len(choices)} layouts fit{more}"])
