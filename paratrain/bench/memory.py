"""Memory estimate: each rank's peak for a strategy, precision and world size, before renting the cluster.

With ``P`` parameters, ``N`` ranks, a micro-batch of ``b`` samples per rank, and per parameter
``w`` bytes of weights, ``g`` of gradients, ``m`` of master weights and ``s`` of optimizer state:

* **precision**: ``32``/``tf32`` and the ``*-mixed`` ones (autocast keeps fp32 weights): w = g = 4,
  m = 0; ``bf16-true``/``fp16-true``: w = g = 2 and fp32 master weights m = 4, whose fp32 gradients
  replace the model's at the optimizer step (4 bytes there, as Megatron-LM's fp32 main gradients);
* **optimizer**: Adam/AdamW s = 8 (two fp32 moments), SGD with momentum s = 4, plain SGD s = 0;
* **model states** per rank:

  - ``single``, ``dp`` (the device that holds the model), ``ps`` workers: ``P(w + g + m + s)``;
  - ``ddp``: the same plus DDP's gradient buckets, ``gP`` (``gradient_as_bucket_view`` off);
  - ``fsdp`` (FSDP2, parameters resharded after forward: ZeRO-3): ``P(w + g + m + s)/N`` plus what
    is unsharded at once: the root group's ``R`` parameters (those outside every block) with their
    gradients, ``R(w + g)``, and two blocks in flight (one computing, one prefetched) of the
    largest block's ``B`` parameters, ``2B(w + g)``;
  - ``tensor`` (tp = N): the ``L`` parameters of the split Linear layers are divided, ``(L/N +
    P − L)(w + g + m + s)``;
  - ``pipeline``: the largest stage's parameters ``S`` (cut as the strategy cuts the model),
    ``S(w + g + m + s)``; on the CPU every rank also keeps the other stages' weights, ``(P − S)w``;
  - a composed layout (``mesh``: ``pp x dp_replicate x dp_shard x tp``, :func:`mesh_states`), its
    dimensions applied in that order: the largest of ``pp`` stages ``S``, its share ``LS/P`` of the
    split Linear layers divided over ``tp``, the rest ``(S − LS/P + LS/(P·tp))`` divided over ``dp_shard``
    (FSDP2, with a block's ``tp`` slice in flight; under a zero-bubble schedule the whole stage's, gathered for the
    step, with its gradients); ``dp_replicate`` keeps whole copies (FSDP2 replicates: no DDP buckets);
    ``dp_shard=N`` alone is fsdp's formula, ``pp=N`` alone pipeline's;

* **activations**: what autograd saves for backward, ``b·a`` with ``a`` bytes per sample measured
  (a pipeline stage: its share ``S/P`` of the blocks' part, and the whole part outside the blocks)
  by one forward on the meta device (no memory, any model size); under ``tp`` the part saved
  between a ``colwise`` Linear and its ``rowwise`` partner (``split_bytes``) is divided by ``tp``. With **activation
  checkpointing** of the blocks only each block's input is kept, plus one block's internals while
  it is recomputed: ``b(a_out + Σ a_in(block) + max a_inside(block))``. Mixed precision halves the
  saved tensors of autocast's low-precision ops; the estimate keeps them fp32 (an upper bound). A
  ``*-true`` model computes everything in its dtype: ``w/4`` of them;
* **CPU offload** (fsdp): parameters, gradients and optimizer state live in host memory; the
  device holds the unsharded blocks in flight and the activations;
* **building the model**: without sharded initialisation every rank first builds the whole model,
  ``4P``; the peak is the larger of that and the training peak.

DeepSpeed's ZeRO paper (Rajbhandari et al. 2020) writes the same model states for mixed-precision
Adam with fp16 weights and gradients and fp32 masters and moments (``2 + 2 + 12 = 16`` bytes per
parameter): ``16P`` for DDP, ``4P + 12P/N`` for ZeRO-1, ``2P + 14P/N`` for ZeRO-2 and ``16P/N`` for
ZeRO-3; :func:`zero_model_states` gives them for comparison. paratrain's ``*-mixed`` precisions keep
fp32 weights and gradients (``4 + 4 + 8 = 16`` bytes per parameter with Adam, the same total),
``bf16-true`` keeps the paper's layout (``2 + 2 + 4 + 8``) between steps and, at the step, the
masters' fp32 gradients in place of the model's (``2 + 4 + 4 + 8``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

__all__ = ["ModelFacts", "Estimate", "measure_model", "estimate", "mesh_states", "zero_model_states", "bytes_per_param",
           "format_estimates", "OPTIMIZER_STATE_BYTES"]

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}
"""Optimizer state bytes per parameter (fp32)."""


@dataclass
class ModelFacts:
    """What the estimate needs to know about a model, measured once on the meta device."""

    params: int
    """P: parameters (tied ones once)."""
    largest_block: int
    """B: parameters of the largest block (fsdp's unit of sharding, activation checkpointing's unit)."""
    root_params: int
    """R: parameters outside every block (embeddings, heads): fsdp's root group."""
    linear_params: int
    """L: parameters of the Linear layers tensor parallelism splits (its plan's)."""
    largest_stage: int
    """S: parameters of the largest of ``stages`` pipeline stages, cut as the pipeline strategy cuts the model."""
    activation_bytes: float
    """a: bytes saved for backward per sample (fp32)."""
    outside_bytes: float = 0.0
    """Of ``activation_bytes``: saved outside every block."""
    block_input_bytes: float = 0.0
    """Σ over blocks of each block's input bytes per sample (what checkpointing keeps)."""
    largest_inside_bytes: float = 0.0
    """The largest block's internal saved bytes per sample (recomputed one block at a time)."""
    largest_saved_bytes: float = 0.0
    """The largest single saved tensor per sample (its gradients arrive while it is alive: the logits)."""
    split_bytes: float = 0.0
    """Of ``activation_bytes``: saved between a ``colwise`` Linear's output and its ``rowwise`` partner's
    (the MLP's hidden features, the attention's heads): tensor parallelism splits them over ``tp``."""
    largest_param: int = 0
    """Elements of the largest parameter tensor (the optimizer's per-tensor temporaries)."""
    largest_linear: bool = False
    """Whether that tensor is a weight tensor parallelism splits."""
    blocks: int = 0
    buffers_bytes: int = 0
    forward_flops: float = 0.0
    """Floating-point operations of one sample's forward (and the loss), counted on the meta device."""
    stage_params: dict[int, int] = field(default_factory=dict)
    """S for each number of stages measured (:func:`measure_model`'s ``stages``): pipelines of every depth asked."""
    schedule: str = "gpipe"
    """The pipeline's schedule the stages were placed for; a zero-bubble one keeps a sharded stage gathered."""
    stage_whole: dict[int, int] = field(default_factory=dict)
    """W for each number of stages measured: of S, the elements two of the rank's stages share (a V's tied embedding
    and head), which stay whole on each data-parallel replica (``strategies/pipeline.py``: ``_ties_within_the_rank``)."""

    def stage(self, stages: int) -> int:
        """S for a pipeline of ``stages`` stages; a one-line error if it was not measured."""
        if stages <= 1:
            return self.params
        if stages in self.stage_params:
            return self.stage_params[stages]
        if not self.stage_params:  # facts made by hand: the one largest_stage
            return self.largest_stage
        raise ValueError(f"the model was measured for pipelines of {sorted(self.stage_params)} stages, not {stages}: "
                         f"pass stages={stages} to measure_model")

    def kept_whole(self, stages: int) -> int:
        """W for a pipeline of ``stages`` stages (0 where no rank's stages share a weight)."""
        return self.stage_whole.get(stages, 0) if stages > 1 else 0

    @property
    def checkpointed_activation_bytes(self) -> float:
        if not self.blocks:
            return self.activation_bytes
        return self.outside_bytes + self.block_input_bytes + self.largest_inside_bytes


def bytes_per_param(precision: str, optimizer: str) -> dict[str, int]:
    """``w``, ``g``, ``m``, ``s``: weight, gradient, master-weight and optimizer-state bytes per parameter."""
    from ..precision import lookup

    true_half = lookup(precision).master_weights  # low-precision weights with fp32 masters
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer {optimizer!r} is unknown to the estimate: use one of "
                         f"{', '.join(OPTIMIZER_STATE_BYTES)}")
    return {"w": 2 if true_half else 4, "g": 2 if true_half else 4, "m": 4 if true_half else 0,
            "s": OPTIMIZER_STATE_BYTES[optimizer]}


@dataclass
class Estimate:
    """One rank's estimated peak, in bytes, and its parts."""

    strategy: str
    precision: str
    world_size: int
    parts: dict[str, float] = field(default_factory=dict)
    checkpointing: bool = False
    offload: bool = False

    @property
    def training(self) -> float:
        return sum(v for k, v in self.parts.items() if k != "build")

    @property
    def peak(self) -> float:
        return max(self.training, self.parts.get("build", 0.0))


def memory_layout(strategy: str, world_size: int) -> str:
    """How ``strategy`` lays a model out over ``world_size`` processes, from its class's facts:
    ``replicas`` (a whole model per process), ``replicas with buckets`` (plus DDP's gradient
    buckets), ``sharded`` (every parameter split: fsdp), ``split linears`` (tensor), ``stages``
    (pipeline). A world of one wraps nothing: ``replicas``."""
    from ..strategies import resolve

    cls = resolve(strategy)
    if world_size <= 1 or cls.processes == "one":
        return "replicas"
    if cls.plain_data_parallel:
        return "replicas with buckets"
    if cls.stage_per_process:
        return "stages"
    shards = cls.data_parallel_size_for(world_size)
    if cls.sharded_state:
        return "sharded" if shards == world_size else "split linears"
    return "replicas"


def estimate(facts: ModelFacts, strategy: str, world_size: int, micro_batch: int, precision: str | None = None,
             optimizer: str = "adamw", checkpointing: bool = False, offload: bool = False,
             sharded_init: bool = False, device: str = "cpu", mesh: Mapping[str, int] | None = None) -> Estimate:
    """Each rank's peak for ``strategy`` at ``world_size`` (see the module's formulas); ``precision``
    defaults to the reference (fp32). ``mesh``: a composed layout instead (its sizes, :mod:`paratrain.strategies.mesh`,
    multiplying to ``world_size``; ``strategy`` is then only its label): :func:`mesh_states`."""
    from ..precision import reference

    precision = precision or reference()
    if world_size < 1 or micro_batch < 1:
        raise ValueError(f"world_size {world_size} and micro_batch {micro_batch} must be at least 1")
    if mesh is not None:
        sharded, local, largest, stage_share, split = mesh_states(facts, mesh, world_size)
        layout = "mesh"
    else:
        layout = memory_layout(strategy, world_size)
        sharded, local, largest, stage_share, split = _strategy_states(facts, layout, world_size)
    if offload and not sharded:
        raise ValueError(f"CPU offload is fsdp's (strategy {strategy!r} keeps its states on the device)")
    b = bytes_per_param(precision, optimizer)
    P = facts.params
    parts: dict[str, float] = {}
    kept = 0.0 if offload and sharded else local
    parts["weights, masters, optimizer state"] = kept * (b["w"] + b["m"] + b["s"])
    if stage_share < 1 and device == "cpu":  # the other stages stay where the model was built: here
        parts["other stages' weights"] = (1 - stage_share) * P * b["w"]
    if layout == "replicas with buckets":
        parts["gradient buckets"] = b["g"] * P  # in the gradients' dtype
    parts["buffers"] = facts.buffers_bytes
    in_flight_fwd = in_flight_bwd = 0.0
    if sharded:
        # forward: the root's parameters and two blocks (one computing, one prefetched); backward:
        # the root's and one block's parameters with their unsharded gradients
        block = facts.largest_block / split  # a block's tensor-parallel slice
        in_flight_fwd = (facts.root_params + 2 * block) * b["w"]
        in_flight_bwd = (facts.root_params + block) * (b["w"] + b["g"])
        from ..strategies._stages import SPLIT_BACKWARD

        if mesh is not None and mesh.get("pp", 1) > 1 and facts.schedule in SPLIT_BACKWARD:
            # a zero-bubble schedule keeps the stage gathered from its first forward to the step's end, with its
            # unsharded gradients (strategies/pipeline.py: _stage_fsdp)
            kept_whole = min(facts.kept_whole(mesh.get("pp", 1)), local)  # not sharded: never gathered
            whole = (local - kept_whole) * mesh.get("dp_shard", 1)
            in_flight_fwd, in_flight_bwd = whole * b["w"], whole * (b["w"] + b["g"])
    act = facts.checkpointed_activation_bytes if checkpointing else facts.activation_bytes
    if split > 1 and not checkpointing:  # each tp rank saves its slice of the split features
        act -= facts.split_bytes * (1 - 1 / split)
    # a pipeline stage saves its own blocks' activations (those outside the blocks, the logits' with the loss, are
    # counted whole: the first and the last stage hold them)
    act = min(act, facts.outside_bytes) + max(0.0, act - facts.outside_bytes) * stage_share
    low = b["w"] / 4 if b["m"] else 1.0  # a *-true model saves its activations in its own dtype
    # plus two gradients the size of the largest saved tensor: a softmax's backward (the loss's, on
    # the logits) holds the gradient of its output and of its input at once, with every activation
    activations = (act + 2 * facts.largest_saved_bytes) * micro_batch * low
    grads = kept * (b["m"] or b["g"])  # at the step: the masters' fp32 gradients, else the model's
    temporaries = _step_temporaries(optimizer, kept, largest, device)
    # The peak comes either at the start of the backward (every saved activation alive) or at its
    # end and in the optimizer step (every gradient, and the step's temporaries).
    parts["activations (forward)" if activations + in_flight_fwd >= grads + temporaries + in_flight_bwd
          else "gradients + step temporaries"] = max(activations + in_flight_fwd, grads + temporaries + in_flight_bwd)
    if not sharded_init:
        parts["build"] = 4 * P + facts.buffers_bytes
    return Estimate(strategy, precision, world_size, parts, checkpointing, offload)


def _strategy_states(facts: ModelFacts, layout: str, n: int) -> tuple[bool, float, int, float, int]:
    """``(sharded, parameters kept per rank, largest tensor's elements, the stage's share of the
    model, tensor-parallel ways)`` for a strategy's ``layout`` (:func:`memory_layout`) over ``n`` ranks."""
    P = facts.params
    if layout == "sharded":
        return True, P / n, math.ceil(facts.largest_param / n), 1.0, 1
    if layout == "split linears":
        largest = math.ceil(facts.largest_param / n) if facts.largest_linear else facts.largest_param
        return False, facts.linear_params / n + P - facts.linear_params, largest, 1.0, n
    if layout == "stages":
        stage = facts.stage(n)
        return False, stage, facts.largest_param, stage / P if P else 1.0, 1
    return False, P, facts.largest_param, 1.0, 1


def mesh_states(facts: ModelFacts, mesh: Mapping[str, int], world_size: int) -> tuple[bool, float, int, float, int]:
    """:func:`_strategy_states` for a composed layout, its dimensions applied as the mesh strategy
    and the pipeline apply them: the largest of ``pp`` stages (its share of the model), the split
    Linear layers of it over ``tp`` (in proportion to the stage's share), then the rest over
    ``dp_shard`` (FSDP2; ``dp_replicate`` keeps whole copies, without DDP's buckets)."""
    from ..strategies.mesh import DIMS, describe

    unknown = sorted(set(mesh) - set(DIMS))
    if unknown:
        raise ValueError(f"mesh {dict(mesh)}: {', '.join(unknown)} is no dimension: use {', '.join(DIMS)}")
    sizes = {d: int(mesh.get(d, 1)) for d in DIMS}
    if any(v < 1 for v in sizes.values()) or math.prod(sizes.values()) != world_size:
        raise ValueError(f"mesh {describe(sizes)} makes {math.prod(sizes.values())} processes, not the world size "
                         f"{world_size}: give sizes >= 1 whose product is {world_size}")
    P = facts.params
    stage = facts.stage(sizes["pp"])
    share = stage / P if P else 1.0
    tp, shard = sizes["tp"], sizes["dp_shard"]
    linear = facts.linear_params * share
    local = stage - linear + linear / tp
    largest = math.ceil(facts.largest_param / tp) if tp > 1 and facts.largest_linear else facts.largest_param
    if shard > 1:  # but for the weights two of the rank's stages share: whole on each replica
        whole = min(facts.kept_whole(sizes["pp"]), local)
        local, largest = (local - whole) / shard + whole, math.ceil(largest / shard)
    return shard > 1, local, largest, share, tp


def _step_temporaries(optimizer: str, params: float, largest: int, device: str) -> float:
    """Adam's update makes ``sqrt(v) / bias_correction`` per tensor: on the CPU (one tensor at a
    time) two temporaries of the largest tensor, on CUDA (``foreach``) one of every parameter."""
    if OPTIMIZER_STATE_BYTES.get(optimizer, 0) < 8:
        return 0.0
    return 4 * params if device == "cuda" else 8 * largest


def zero_model_states(params: int, world_size: int, stage: int) -> float:
    """DeepSpeed's ZeRO model-state bytes per GPU for mixed-precision Adam (``K = 12``):
    stage 0 (DDP) ``16P``, 1 ``4P + 12P/N``, 2 ``2P + 14P/N``, 3 ``16P/N``."""
    P, n = params, world_size
    return {0: 16 * P, 1: 4 * P + 12 * P / n, 2: 2 * P + 14 * P / n, 3: 16 * P / n}[stage]


# --------------------------------------------------------------------------- measuring a model
def _numel(t: torch.Tensor) -> int:
    return int(t.numel())


def measure_model(build: Callable[[], nn.Module], sample: Callable[[int], Any],
                  loss: Callable[[Any, Any], torch.Tensor] | None = None,
                  stages: int | Sequence[int] = 2, schedule: str = "gpipe", stages_per_rank: int = 1) -> ModelFacts:
    """Build ``build()`` on the meta device and run a forward (and the loss) on ``sample(k)``
    (the model's input for ``k`` samples, built on the meta device too; a tuple is unpacked as
    positional arguments) at two batch sizes: the bytes autograd saves per sample are the difference.
    Blocks are fsdp's default units (:func:`paratrain.strategies.fsdp._blocks`); the Linear layers
    tensor parallelism splits are its automatic plan's (or every Linear, if it finds no pair);
    ``stages``: the pipeline depths to cut it for (the first is ``largest_stage``), each rank holding
    ``stages_per_rank`` stages placed as ``schedule`` places them (:class:`~paratrain.strategies._stages.PipelineOptions`)."""
    from ..strategies.fsdp import _blocks
    from ..strategies.tensor import auto_plan

    with torch.device("meta"):
        model = build()
    params = {id(p): p for p in model.parameters()}
    P = sum(_numel(p) for p in params.values())
    blocks = [blk for blk in _blocks(model, [], 0)]
    outermost = [blk for blk in blocks if not any(o is not blk and any(m is blk for m in o.modules()) for o in blocks)]
    in_block = {id(p) for blk in outermost for p in blk.parameters()}
    sizes = [sum(_numel(p) for p in blk.parameters()) for blk in outermost]
    plan = auto_plan(model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    split = [linears[n] for n in plan if n in linears] or list(linears.values())
    L = sum(_numel(p) for m in {id(m): m for m in split}.values() for p in m.parameters(recurse=False))
    root = sum(_numel(p) for pid, p in params.items() if pid not in in_block)
    buffers = sum(_numel(buf) * buf.element_size() for buf in model.buffers())

    from torch.utils.flop_counter import FlopCounterMode

    opens = [m for n, m in linears.items() if plan.get(n) == "colwise"]  # a split region: colwise ... rowwise
    closes = [m for n, m in linears.items() if plan.get(n) == "rowwise"]

    def saved(k: int) -> tuple[float, float, float, list[float], float, float, float]:
        """(total, outside blocks, block inputs, [inside each block], largest, flops, split) saved for backward at batch k."""
        stack: list[int] = []
        inside = [0.0] * len(outermost)
        inputs = [0.0] * len(outermost)
        totals = {"all": 0.0, "out": 0.0, "largest": 0.0, "split": 0.0}
        region = [False]
        index = {id(blk): i for i, blk in enumerate(outermost)}

        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if id(t) in params or t._base is not None and id(t._base) in params:
                return t  # a parameter (or a view of one) costs no extra memory
            storage = t.untyped_storage()
            if storage._cdata in seen:  # saved twice (by two ops, or as views): one memory
                return t
            seen.add(storage._cdata)
            nbytes = storage.nbytes()
            totals["all"] += nbytes
            totals["largest"] = max(totals["largest"], nbytes)
            if stack:
                inside[stack[-1]] += nbytes
            else:
                totals["out"] += nbytes
            if region[0]:
                totals["split"] += nbytes
            return t

        def split_region(value: bool) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, out: Any) -> None:
                region[0] = value
            return hook

        def pre(module: nn.Module, args: Any) -> None:
            i = index[id(module)]
            inputs[i] += sum(_numel(a) * a.element_size() for a in args if isinstance(a, torch.Tensor))
            stack.append(i)

        def post(module: nn.Module, args: Any, out: Any) -> None:
            stack.pop()

        handles = [blk.register_forward_pre_hook(pre) for blk in outermost]
        handles += [blk.register_forward_hook(post) for blk in outermost]
        handles += [m.register_forward_hook(split_region(True)) for m in opens]
        handles += [m.register_forward_hook(split_region(False)) for m in closes]
        counter = FlopCounterMode(display=False)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
                x = sample(k)
                out = model(*x) if isinstance(x, tuple) else model(x)
                if loss is not None:
                    loss(out, k)
        finally:
            for h in handles:
                h.remove()
        return (totals["all"], totals["out"], sum(inputs), inside, totals["largest"], float(counter.get_total_flops()),
                totals["split"])

    with torch.device("meta"):  # batches of 2 and 4: BatchNorm refuses one sample in training
        small, big = saved(2), saved(4)

    def per_sample(a: float, b: float) -> float:
        return max(0.0, (b - a) / 2)

    inside = [per_sample(a, b) for a, b in zip(small[3], big[3])]
    depths = [stages] if isinstance(stages, int) else list(dict.fromkeys(stages)) or [2]
    cuts = {n: _largest_stage(model, n, schedule, stages_per_rank) for n in depths}
    biggest = max((_numel(p) for p in params.values()), default=0)
    return ModelFacts(
        params=P, largest_block=max(sizes, default=0), root_params=root, linear_params=L,
        largest_stage=cuts[depths[0]][0], stage_params={n: held for n, (held, _) in cuts.items()},
        stage_whole={n: whole for n, (_, whole) in cuts.items() if whole}, activation_bytes=per_sample(small[0], big[0]),
        outside_bytes=per_sample(small[1], big[1]), block_input_bytes=per_sample(small[2], big[2]),
        largest_inside_bytes=max(inside, default=0.0), largest_saved_bytes=per_sample(small[4], big[4]),
        largest_param=biggest, largest_linear=any(p.numel() == biggest for m in split for p in m.parameters(recurse=False)),
        blocks=len(outermost), forward_flops=per_sample(small[5], big[5]), split_bytes=per_sample(small[6], big[6]),
        buffers_bytes=buffers, schedule=schedule)


def _largest_stage(model: nn.Module, stages: int, schedule: str = "gpipe", per_rank: int = 1) -> tuple[int, int]:
    """``(held, shared)``: parameters of the pipeline rank that holds the most, of ``stages`` ranks, each holding ``per_rank``
    stages placed as ``schedule`` places them: cut by the pipeline strategy's own rule
    (:func:`paratrain.strategies._stages.cut_stages`: top-level children, or a stack of blocks cut between
    blocks) and placement (:func:`~paratrain.strategies._stages.stage_ranks`); a parameter two of a rank's
    stages share (a tied embedding and head in a V) counted once, and in ``shared``. The whole model where it cannot
    cut it (or ``stages`` is 1)."""
    from ..strategies._stages import cut_stages, stage_ranks
    from ..strategies.base import NotApplicable

    whole = sum(_numel(p) for p in {id(p): p for p in model.parameters()}.values())
    if stages <= 1:
        return whole, 0
    try:
        parts = cut_stages(model, stages * per_rank)
    except NotApplicable:
        return whole, 0
    held: list[dict[int, int]] = [{} for _ in range(stages)]
    first: list[dict[int, int]] = [{} for _ in range(stages)]  # id(parameter) -> the rank's first stage holding it
    shared: list[dict[int, int]] = [{} for _ in range(stages)]
    for index, (part, rank) in enumerate(zip(parts, stage_ranks(schedule, stages, stages * per_rank))):
        for p in part.parameters():
            held[rank][id(p)] = _numel(p)
            if first[rank].setdefault(id(p), index) != index:
                shared[rank][id(p)] = _numel(p)
    top = max(range(stages), key=lambda r: sum(held[r].values()))
    return sum(held[top].values()), sum(shared[top].values())


# --------------------------------------------------------------------------- report
def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def format_estimates(facts: ModelFacts, estimates: Sequence[Estimate], title: str) -> str:
    lines = [title,
             f"parameters {facts.params:,} (largest block {facts.largest_block:,}, outside blocks {facts.root_params:,}, "
             f"split by tensor {facts.linear_params:,}); activations {_mib(facts.activation_bytes)} MiB per sample, "
             f"{_mib(facts.checkpointed_activation_bytes)} MiB with activation checkpointing of {facts.blocks} blocks"]
    head = ("strategy", "world", "precision", "options", "states MiB", "peak phase", "peak MiB per rank")
    rows = []
    for e in estimates:
        states = sum(v for k, v in e.parts.items() if k in ("weights, masters, optimizer state", "gradient buckets"))
        opts = ",".join(o for o, on in (("checkpointing", e.checkpointing), ("offload", e.offload)) if on) or "-"
        phase = "forward" if "activations (forward)" in e.parts else "step"
        if e.parts.get("build", 0.0) > e.training:
            phase = "building the model"
        rows.append((e.strategy, str(e.world_size), e.precision, opts, _mib(states), phase, _mib(e.peak)))
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines += [fmt.format(*head), *(fmt.format(*r) for r in rows)]
    return "\n".join(lines)
