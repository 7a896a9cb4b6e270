"""Sharded initialisation: build a model on the meta device, then give each rank only its shard,
with exactly the values the model would have had if it had been built whole.

While the model is built (:class:`Recorder`, a ``TorchDispatchMode`` that makes every CPU tensor
on the meta device instead) every operation on its meta tensors is recorded: ``empty``, ``normal_``, ``uniform_``, ``mul_``,
``arange``... A random operation also runs once for real on a throwaway CPU tensor of the same size,
so the CPU generator advances exactly as it would have in a whole build, and the generator's state
before it is kept. :func:`materialize` then replays, one parameter at a time, the operations that
made it, with the generator set to each random operation's saved state: the full tensor exists only
while that parameter's shard is copied out of it. No rank ever holds more than its shards plus the
largest single tensor. Tied parameters are one tensor; buffers are replayed whole.

What cannot be replayed is refused in one line naming the parameter (an in-place write through a
view of it, a value made outside the ``init_module`` block): build such a model whole.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["Recorder", "Deferred", "Held", "materialize", "recorded_values", "has_meta"]


_Key = tuple[int, tuple[int, ...], tuple[int, ...], int]


def _key(t: torch.Tensor) -> _Key:
    """A tensor's identity as the data it shows: its storage and its geometry."""
    return (int(t.untyped_storage()._cdata), tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))


@dataclass
class _Node:
    func: Any
    args: Any
    kwargs: Any
    rng: torch.Tensor | None
    out_index: int | None = None
    """Which output of ``func`` this node is (None: the only one)."""


@dataclass
class _Ref:
    node: _Node


class _Scratch:
    """One buffer, grown to the largest tensor asked of it, lent as a tensor of any shape and dtype."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def take(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # the old buffer goes first
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return self.buffer[:nbytes].view(dtype).view(shape)


@dataclass
class Recorder(TorchDispatchMode):
    """Records how every meta tensor built under it got its value (see the module docstring)."""

    latest: dict[_Key, _Node] = field(default_factory=dict)
    stale: dict[_Key, str] = field(default_factory=dict)
    scratch: _Scratch = field(default_factory=lambda: _Scratch())
    """What a random operation runs on for real. A fresh tensor each time would leave the heap
    fragmented (the small records made in between split each freed block), and the process
    would keep a whole model's worth of freed pages."""

    def __post_init__(self) -> None:
        super().__init__()

    def _scratch_like(self, x: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU tensor like the meta tensor ``x``, on :attr:`scratch` (as on a fresh
        one, the generator advances alike)."""
        return self.scratch.take(x.shape, x.dtype)

    def _ref(self, x: Any) -> Any:
        if _is_meta(x):
            node = self.latest.get(_key(x))
            return _Ref(node) if node is not None else _Missing(tuple(x.shape))
        return x

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        factory = not any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
        if factory and "device" in kwargs and (kwargs["device"] is None or torch.device(kwargs["device"]).type == "cpu"):
            # built for the CPU (the default device): on the meta device instead. Not torch.device("meta")
            # as a context: libraries that skip their init on a meta default device (HuggingFace) run it
            kwargs["device"] = torch.device("meta")
        rng = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            rng = torch.get_rng_state()
            first = iter([self._scratch_like])  # the first meta tensor on the scratch buffer, any other fresh
            real_args = tree_map(lambda x: next(first, _real_like)(x) if _is_meta(x) else _real_like(x), args)
            real_kwargs = tree_map(_real_like, kwargs)
            if "device" in real_kwargs:
                real_kwargs["device"] = torch.device("cpu")
            func(*real_args, **real_kwargs)  # the CPU generator advances as a whole build's would
        out = func(*args, **kwargs)
        node_args, node_kwargs = tree_map(self._ref, args), tree_map(self._ref, kwargs)
        written = [a for a, spec in zip(args, func._schema.arguments)
                   if isinstance(a, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write]
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        fresh = factory  # a new storage
        for i, o in enumerate(outputs):
            if isinstance(o, torch.Tensor) and o.device.type == "meta":
                self.latest[_key(o)] = _Node(func, node_args, node_kwargs, rng, i if len(outputs) > 1 else None)
                if fresh:  # a storage freed earlier may come back at the same address: it is new data now
                    self.stale.pop(_key(o), None)
        for w in written:  # an in-place write: other views of the same storage now show other data
            storage = w.untyped_storage()._cdata
            for key in [k for k in self.latest if k[0] == storage and k != _key(w)]:
                self.stale[key] = str(func)
        return out


@dataclass
class _Missing:
    shape: tuple[int, ...]


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _real_like(x: Any) -> Any:
    if _is_meta(x):
        return torch.empty(x.shape, dtype=x.dtype)
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


def has_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


class _Replay:
    """Evaluates recorded nodes on the CPU, each at most once per parameter.

    A value that only one operation reads is written in place (it is not copied first), and the
    first ``empty`` of the parameter is made on ``scratch``: a parameter's value then costs no new
    memory, and a whole stage valued one parameter at a time leaves no freed blocks behind."""

    def __init__(self, root: _Node, scratch: _Scratch | None = None) -> None:
        self.memo: dict[int, torch.Tensor] = {}
        self.uses: dict[int, int] = {}
        self.scratch = scratch
        self._count(root, set())

    def _count(self, node: _Node, seen: set[int]) -> None:
        seen.add(id(node))
        for x in tree_flatten((node.args, node.kwargs))[0]:
            if isinstance(x, _Ref):
                self.uses[id(x.node)] = self.uses.get(id(x.node), 0) + 1
                if id(x.node) not in seen:
                    self._count(x.node, seen)

    def value(self, node: _Node) -> torch.Tensor:
        if id(node) in self.memo:
            return self.memo[id(node)]

        def real(x: Any) -> Any:
            if isinstance(x, _Ref):
                return self.value(x.node)
            if isinstance(x, _Missing):
                raise _Unreplayable(f"a tensor of shape {list(x.shape)} made outside the init_module block")
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            return x

        args, kwargs = tree_map(real, node.args), tree_map(real, node.kwargs)
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        schema = node.func._schema.arguments
        args = [a.clone() if isinstance(a, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write
                and not (isinstance(given, _Ref) and self.uses.get(id(given.node)) == 1) else a
                for a, spec, given in zip(args, schema, node.args)] + list(args[len(schema):])  # a value read again stays
        if node.rng is not None:
            torch.set_rng_state(node.rng)
        if node.func is torch.ops.aten.empty.memory_format and self.scratch is not None and \
                kwargs.get("memory_format") in (None, torch.contiguous_format):
            out = self.scratch.take(args[0], kwargs.get("dtype") or torch.get_default_dtype())
            self.scratch = None  # one per parameter: another empty of it gets its own memory
        else:
            out = node.func(*args, **kwargs)
        if node.out_index is not None:
            out = out[node.out_index]
        self.memo[id(node)] = out
        return out


class _Unreplayable(Exception):
    pass


def recorded_values(recorder: Recorder, model: nn.Module) -> dict[str, Callable[..., torch.Tensor]]:
    """For each parameter and buffer name of the (still unsharded, meta) ``model``: a function that
    computes its full value on the CPU. Call before the model is sharded."""
    out: dict[str, Callable[..., torch.Tensor]] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if t.device.type != "meta":
            continue
        key = _key(t)
        if key in recorder.stale:
            raise ValueError(f"init_module cannot rebuild {name!r}: it was written through a view of it "
                             f"({recorder.stale[key]}); build this model whole (without init_module)")
        node = recorder.latest.get(key)
        if node is None:
            raise ValueError(f"init_module cannot rebuild {name!r}: it was not made inside the init_module block; "
                             "build the whole model inside it")
        out[name] = _thunk(node, name)
    return out


def _thunk(node: _Node, name: str) -> Callable[..., torch.Tensor]:
    def compute(scratch: _Scratch | None = None) -> torch.Tensor:
        """The value (on ``scratch``, if given: copy it out before the next call)."""
        try:
            return _Replay(node, scratch).value(node)
        except _Unreplayable as e:
            raise ValueError(f"init_module cannot rebuild {name!r}: it depends on {e}") from None

    return compute


class Held(NamedTuple):
    """The parts of a model one rank holds values of (a pipeline rank: its stage)."""

    modules: tuple[nn.Module, ...]
    """Held whole, their children too."""
    buffers_of: tuple[nn.Module, ...] = ()
    """Modules whose own buffers are held (not their children's): what every stage runs."""


@torch.no_grad()
def materialize(model: nn.Module, values: dict[str, Callable[..., torch.Tensor]], device: torch.device,
                held: Held | None = None) -> None:
    """Allocate ``model``'s meta parameters and buffers on ``device`` (each rank its shards: the
    model may be sharded by now) and fill them from ``values`` (:func:`recorded_values`).
    ``held``: the parts of ``model`` this rank holds (default: all of it); the rest stays on the
    meta device, and no value of it is computed."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    state = torch.get_rng_state()
    held = held or Held((model,))
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # each parameter stays the object an optimizer holds
    try:
        for part in held.modules:
            part.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    for module in held.buffers_of:
        for key, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[key] = torch.empty_like(buffer, device=device)
    kept = {id(t) for part in held.modules for t in (*part.parameters(), *part.buffers())}
    kept |= {id(b) for module in held.buffers_of for b in module.buffers(recurse=False)}
    done: set[int] = set()
    scratch = _Scratch()
    try:
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            if id(t) in done or name not in values or id(t) not in kept:
                continue
            done.add(id(t))
            full = values[name](scratch)
            if isinstance(t, DTensor):
                local = distribute_tensor(full.to(device), t.device_mesh, t.placements, src_data_rank=None).to_local()
                t.to_local().copy_(local)
            else:
                t.copy_(full)
    finally:
        torch.set_rng_state(state)  # the generator goes on from where the whole build left it


class Deferred:
    """``Parallel.init_module``'s state: whether to build on the meta device, and what was recorded."""

    def __init__(self, meta: bool, device: torch.device) -> None:
        self.meta, self.device = meta, device
        self.recorder: Recorder | None = None

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        if not self.meta:  # nothing is sharded: build it whole, on this rank's device
            with self.device:
                yield
            return
        recorder = Recorder()
        try:
            with recorder:
                yield
        finally:
            recorder.scratch = _Scratch()  # its memory back
        self.recorder = recorder

    def values(self, model: nn.Module) -> dict[str, Callable[..., torch.Tensor]]:
        """What :meth:`materialize` fills ``model`` with ({} for a model not built under :meth:`context`)."""
        if self.recorder is None or not has_meta(model):
            return {}
        return recorded_values(self.recorder, model)

    def materialize(self, model: nn.Module, values: dict[str, Callable[..., torch.Tensor]], held: Held | None = None) -> None:
        if values:
            materialize(model, values, self.device, held)
