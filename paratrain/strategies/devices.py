"""``devices``: the naive model split ("network partitioning") — consecutive parts of one model on different
devices of one process, the activations moved from device to device in forward.

The usual hand-written split, as a strategy::

    x = self.part1(x.to("cuda:0"))
    x = self.part2(x.to("cuda:1"))

It lets a model larger than one device's memory train in one process. With ``micro_batches = 1``
(the default) only one device computes at a time. With ``micro_batches = k`` each batch is cut into
k chunks that flow through the parts as in GPipe (PyTorch's model-parallel tutorial, in one
process): part s+1 works on chunk i while part s computes chunk i+1, each part in its own thread
(:func:`paratrain.threads.fork_map`, one clock tick at a time, as torchgpipe schedules it).
The model is cut at its top-level children like ``pipeline`` cuts it (``split_points``, or balanced
by parameter count). On a machine without GPUs every part lands on the CPU, through the same code
and ``.to()`` moves, and the parts are threads on the CPU's cores.

Backward with micro-batches: on the CPU, one ``loss.backward()`` runs every node in the calling
thread, so the pipelined forward alone would leave backward sequential. When every part is on
the CPU, the split is one autograd function whose backward runs the chunks' backward per part
with ``torch.autograd.grad`` in the parts' threads, in the reverse clock order (part s-1 on chunk
i while part s does chunk i+1), and sums each parameter's chunk gradients in chunk order. On CUDA
the autograd engine already runs each device's backward in its own thread, so the forward is
pipelined and backward is left to the engine. Either way the gradients are those of the whole
batch (the loss is computed on the concatenated output), up to the rounding of summing k chunk
gradients instead of one matmul over the batch; double backward through a pipelined CPU split is
not supported.

What changes with micro-batches: BatchNorm normalises each chunk on its own (and updates its
running statistics k times), like ``pipeline``; dropout on CPU parts draws from the one CPU
generator from several threads, so its masks depend on thread timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..env.process import Dist
from ..threads import fork_map
from ._split import check_sequential, is_plain_sequential, parse_split_points, split_model
from .base import Strategy

__all__ = ["DevicesOptions", "DeviceSplit", "DevicesStrategy", "default_devices"]


@dataclass(kw_only=True)
class DevicesOptions:
    """Devices settings."""

    devices: list[str] = field(default_factory=list)
    """One device per part, in forward order (e.g. ["cuda:0", "cuda:1"]). Empty: every visible
    CUDA device, or ["cpu", "cpu"] without one."""
    split_points: list[str] = field(default_factory=list)
    """Top-level children that start parts 2..N. Empty: parameter counts as even as possible."""
    micro_batches: int = 1
    """Chunks each batch is cut into and pipelined over the parts (part s+1 on chunk i while part s
    computes chunk i+1). 1: the parts run one after another on the whole batch. BatchNorm then
    normalises each chunk on its own."""

    def __post_init__(self) -> None:
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"devices micro_batches {self.micro_batches!r} must be an integer of at least 1")
        if isinstance(self.devices, str):  # from the command line: "cuda:0,cuda:1"
            self.devices = [d.strip() for d in self.devices.split(",") if d.strip()]
        for d in self.devices:
            try:
                torch.device(d)
            except (RuntimeError, TypeError):
                raise ValueError(f"devices: {d!r} is not a device: use names like cpu, cuda:0, cuda:1") from None
        self.split_points = parse_split_points(self.split_points, "devices")


def default_devices(process_device: torch.device) -> list[str]:
    """Every visible CUDA device when this process runs on CUDA, else two CPU parts."""
    if process_device.type == "cuda" and torch.cuda.device_count() > 0:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu", "cpu"]


class DeviceSplit(nn.Module):
    """``parts[i]`` on ``devices[i]``; forward moves the activations into each part's device and
    returns the output on ``output_device`` (where the batches and targets are). With
    ``micro_batches > 1`` the batch is cut into that many chunks, pipelined over the parts."""

    original: nn.Module
    pipelined_backward: bool = True
    """With micro-batches on CPU parts: pipeline backward too. False: pipeline forward only and leave
    backward to the autograd engine (what CUDA parts get); ``benchmarks/threads.py`` compares them."""

    def __init__(self, parts: Sequence[nn.Module], devices: list[torch.device], output_device: torch.device,
                 original: nn.Module, micro_batches: int = 1) -> None:
        super().__init__()
        self.parts = nn.ModuleList(part.to(device) for part, device in zip(parts, devices))
        self.devices = list(devices)
        self.output_device = output_device
        self.micro_batches = micro_batches
        object.__setattr__(self, "original", original)  # not a submodule: no duplicate parameters
        # The cut is checked against the model's own forward once, where that forward can run at all.
        self._check_pending = len(set(self.devices)) == 1 and not is_plain_sequential(original)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._check_pending:
            self._check_pending = False
            check_sequential(self.original, list(self.parts), x.to(self.devices[0]), "devices")
        chunks = min(self.micro_batches, x.shape[0]) if x.dim() else 1
        if chunks <= 1:
            for part, device in zip(self.parts, self.devices):
                x = part(x.to(device))
            return x.to(self.output_device)
        params = [[p for p in part.parameters() if p.requires_grad] for part in self.parts]
        if (self.pipelined_backward and torch.is_grad_enabled() and (x.requires_grad or any(params))
                and all(d.type == "cpu" for d in self.devices)):
            return _PipelinedParts.apply(self, chunks, params, x, *[p for ps in params for p in ps])
        outs = _pipeline_forward(self, x.tensor_split(chunks))
        return torch.cat([o.to(self.output_device) for o in outs])


def _clock(n_parts: int, n_chunks: int, reverse: bool = False) -> list[list[tuple[int, int]]]:
    """GPipe's clock ticks, lists of (part, chunk): at tick t part s works on chunk t - s
    (torchgpipe's ``_clock_cycles``); ``reverse``: the backward order, part s on chunk
    t - (n_parts - 1 - s)."""
    ticks = []
    for t in range(n_parts + n_chunks - 1):
        tick = [(r, t - r) for r in range(n_parts) if 0 <= t - r < n_chunks]
        ticks.append([(n_parts - 1 - s, i) for s, i in tick] if reverse else tick)
    return ticks


def _run_ticks(ticks: list[list[tuple[int, int]]], task: Callable[[int, int], None]) -> None:
    """``task(part, chunk)`` for every tick's pairs, concurrently within a tick (one thread per part)."""
    for tick in ticks:
        fork_map(lambda si: task(*si), tick)


def _pipeline_forward(split: DeviceSplit, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Forward of every chunk through every part, pipelined; autograd records as it would unpipelined."""
    acts = list(chunks)

    def task(s: int, i: int) -> None:
        acts[i] = split.parts[s](acts[i].to(split.devices[s]))

    _run_ticks(_clock(len(split.parts), len(acts)), task)
    return acts


class _PipelinedParts(torch.autograd.Function):
    """A CPU split with micro-batches as one autograd node. Forward pipelines the chunks and keeps
    each (part, chunk)'s own small graph; backward pipelines ``torch.autograd.grad`` over those in
    the reverse clock order, so that the parts' backward overlaps too (one ``loss.backward()``
    would run all of them one node at a time in the calling thread)."""

    @staticmethod
    def forward(ctx: Any, split: DeviceSplit, n_chunks: int, params: list[list[nn.Parameter]], x: torch.Tensor,
                *flat_params: nn.Parameter) -> torch.Tensor:
        chunks = x.detach().tensor_split(n_chunks)
        graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        acts: list[torch.Tensor] = list(chunks)

        def task(s: int, i: int) -> None:
            inp = acts[i].to(split.devices[s]).requires_grad_(s > 0 or x.requires_grad)
            with torch.enable_grad():  # Function.forward runs without grad: record this chunk's graph
                # The part sees a non-leaf copy, as it would unpipelined (an in-place first layer,
                # e.g. ReLU(inplace=True), refuses a leaf that requires grad).
                out = split.parts[s](inp.clone() if inp.requires_grad else inp)
            graphs[(s, i)] = (inp, out)
            acts[i] = out.detach()

        _run_ticks(_clock(len(split.parts), n_chunks), task)
        ctx.graphs, ctx.params, ctx.n_chunks, ctx.sizes = graphs, params, n_chunks, [c.shape[0] for c in chunks]
        ctx.input_device = x.device
        return torch.cat([a.to(split.output_device) for a in acts])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        graphs, params, n_chunks = ctx.graphs, ctx.params, ctx.n_chunks
        if graphs is None:
            raise RuntimeError("devices with micro_batches: backward through one pipelined forward runs once "
                               "(retain_graph is not supported)")
        ctx.graphs = None
        grads: list[Any] = list(grad_out.split(ctx.sizes))  # grads[i]: d loss / d (chunk i's current output)
        part_grads: dict[tuple[int, int], Sequence[Any]] = {}

        def task(s: int, i: int) -> None:
            inp, out = graphs.pop((s, i))
            wrt = ([inp] if inp.requires_grad else []) + params[s]
            if grads[i] is None or not out.requires_grad or not wrt:
                part_grads[(s, i)], grads[i] = [None] * len(params[s]), None
                return
            got = torch.autograd.grad(out, wrt, grads[i].to(out.device), allow_unused=True)
            part_grads[(s, i)] = got[len(got) - len(params[s]):]
            grads[i] = got[0] if inp.requires_grad else None

        _run_ticks(_clock(len(params), n_chunks, reverse=True), task)
        flat: list[Any] = []
        for s, ps in enumerate(params):
            for j in range(len(ps)):
                total = None
                for i in range(n_chunks):  # in chunk order: the same sum whatever the threads' timing
                    g = part_grads[(s, i)][j]
                    if g is not None:
                        total = g if total is None else total + g
                flat.append(total)
        grad_x = None
        if ctx.needs_input_grad[3] and all(g is not None for g in grads):
            grad_x = torch.cat([g.to(ctx.input_device) for g in grads])
        return (None, None, None, grad_x, *flat)


class DevicesStrategy(Strategy):
    name = "devices"
    processes = "one"
    master_weights = True
    in_process_micro_batches = True  # options.micro_batches pipelines the parts in this process
    bench_default = "full"  # sequential and pipelined (micro_batches) cells: on a CPU the parts are threads
    options_class = DevicesOptions

    def __init__(self, dist_info: Dist, sync_batchnorm: bool = False, options: DevicesOptions | None = None, **common: Any) -> None:
        super().__init__(dist_info, sync_batchnorm, options or DevicesOptions(), **common)

    def setup_model(self, model: nn.Module) -> nn.Module:
        # No model.to(self.device): each part goes to its own device.
        if self.sync_batchnorm:
            self.warn("sync_batchnorm has no effect with devices: one process already sees the whole batch")
        return self.wrap(model)

    def wrap(self, model: nn.Module) -> nn.Module:
        o: DevicesOptions = self.options
        devices = [torch.device(d) for d in (o.devices or default_devices(self.device))]
        parts = split_model(model, len(devices), o.split_points, "devices")
        if o.micro_batches > 1:
            if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
                self.warn(f"devices micro_batches={o.micro_batches}: BatchNorm normalises each micro-batch on its own "
                          "(and updates its running statistics once per micro-batch), not the whole batch")
            if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()) \
                    and any(d.type == "cpu" for d in devices):
                self.warn(f"devices micro_batches={o.micro_batches}: the CPU parts draw their dropout masks from one "
                          "generator in several threads, so the masks depend on thread timing (runs are not "
                          "bit-reproducible); use micro_batches=1 where they must be")
        return DeviceSplit(parts, devices, self.device, model, micro_batches=o.micro_batches)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.original if isinstance(model, DeviceSplit) else model
