"""Cut a model built as embeddings -> a stack of blocks -> a head into pipeline stages at block
boundaries: a nanoGPT-style GPT, HuggingFace's GPT-2 and Llama families, a BERT encoder.

Such a model cannot be cut at its top-level children (its blocks sit in a ``ModuleList``, its
forward computes positions, masks and rotary embeddings), so each stage runs the model's *own*
forward with the stack narrowed to its blocks:

* the stack is the ``ModuleList`` (or ``Sequential``) of one block class holding the most
  parameters; a probe forward of a two-token input, in eval mode and without gradients, records
  which modules with parameters run before the stack (the embeddings: the first stage's) and
  after it (the final norm and head: the last stage's);
* stage *i* owns its blocks, plus those modules on the first and last stage. Its forward puts only
  its blocks in the stack, feeds the incoming hidden state to its first block (the embeddings it
  does not own give zeros of their shape: their output is replaced), and ends at its last block,
  whose output it returns; the last stage returns the model's logits;
* a parameter two stages own (GPT-2's ``lm_head`` is its token embedding) has its gradient summed
  between them after every backward (:meth:`StackStage.sync_shared`), so both copies step alike,
  as Megatron-LM's embedding group does.

Each stage's ``state_dict`` keys are the model's own (a stage holds the model's modules under
their own names), so checkpoints move between pipeline depths and strategies. Forwards that take
more than the token ids, or stacks whose blocks are not called in a loop over the container, are
caught by the pipeline's first-step check (the stages chained must compute the model's output).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..dtensors import local_part
from ._split import balanced_cuts, output_tensor
from .base import NotApplicable

__all__ = ["find_stack", "split_stack", "StackStage"]


class _Cut(Exception):
    """Raised by a non-last stage's last block to end the model's forward with its output."""

    def __init__(self, hidden: Any) -> None:
        super().__init__()
        self.hidden = hidden


def find_stack(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(qualified name, container)`` of the stack of blocks holding the most parameters: a
    ``ModuleList``/``Sequential`` of two or more modules of one class; None if there is none."""
    best: tuple[int, str, nn.Module] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or module is model:
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size and (best is None or size > best[0]):
            best = (size, name, module)
    return None if best is None else (best[1], best[2])


def _probe(model: nn.Module, stack: nn.Module) -> tuple[list[str], list[str], dict[str, int]]:
    """Names of the modules with parameters of their own that run before and after the stack in a
    forward of two tokens, and each embedding's output width (what its stand-in returns)."""
    blocks = list(stack.children())
    inside = {id(m) for b in blocks for m in b.modules()}
    phase = ["before"]
    seen: dict[str, list[str]] = {"before": [], "after": []}
    widths: dict[str, int] = {}
    hooks = [blocks[0].register_forward_pre_hook(lambda *_: phase.__setitem__(0, "inside")),
             blocks[-1].register_forward_hook(lambda *_: phase.__setitem__(0, "after"))]

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if phase[0] != "inside" and name not in seen[phase[0]]:
                seen[phase[0]].append(name)
            if isinstance(out, torch.Tensor) and out.dim() >= 1:
                widths[name] = out.shape[-1]
        return hook

    for name, module in model.named_modules():
        if id(module) not in inside and any(True for _ in module.parameters(recurse=False)):
            hooks.append(module.register_forward_hook(record(name)))
    modes = [(m, m.training) for m in model.modules()]
    device = next(model.parameters()).device
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros((1, 2), dtype=torch.long, device=device))
    except Exception as e:  # noqa: BLE001 - a forward that does not take token ids: not a stack model
        raise NotApplicable(f"pipeline: cannot cut {type(model).__name__} at its blocks: its forward did not run on "
                            f"token ids ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})") from None
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes:
            m.training = training
    if phase[0] != "after":
        raise NotApplicable(f"pipeline: cannot cut {type(model).__name__} at its blocks: its forward does not run "
                            "them in order")
    return seen["before"], seen["after"], widths


def _mirror(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """A module tree holding ``model``'s modules ``names`` at their own paths (state_dict keys as
    the model's), sharing them; empty ``nn.Module`` parents in between."""
    root = nn.Module()
    for name in names:
        node, parts = root, name.split(".")
        for part in parts[:-1]:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        if not hasattr(node, parts[-1]):
            node.add_module(parts[-1], model.get_submodule(name))
    return root


class StackStage(nn.Module):
    """One pipeline stage of a stack model: runs the model's forward over its own blocks. Its
    children are the model's modules it owns, at their own paths (its ``state_dict`` keys are the
    model's); its own attributes start with ``_``, so they never meet a model's child name."""

    _whole: nn.Module

    def __init__(self, model: nn.Module, stack_name: str, start: int, end: int, first: bool, last: bool,
                 owned: Sequence[str], stand_ins: dict[str, int]) -> None:
        super().__init__()
        for name, child in _mirror(model, owned).named_children():
            self.add_module(name, child)
        object.__setattr__(self, "_whole", model)  # not a submodule: the whole model is not this stage's
        self._stack_name, self._start, self._end, self._first, self._last = stack_name, start, end, first, last
        self._stand_ins = stand_ins  # embeddings this stage does not own -> their width
        self._owned = list(owned)  # the model's modules it holds, by name
        self._shared: list[tuple[nn.Parameter, Any]] = []  # (parameter another stage owns too, their group)
        self._counted_elsewhere: list[nn.Parameter] = []  # shared parameters an earlier stage counts in the norm

    def run_outside(self) -> list[nn.Module]:
        """The parameter-free modules outside the stack, which every stage runs (a rotary
        embedding, with its frequencies as buffers)."""
        inside = {id(m) for m in self._whole.get_submodule(self._stack_name).modules()}
        return [m for m in self._whole.modules()
                if id(m) not in inside and not any(True for _ in m.parameters(recurse=False))]

    def place(self, device: torch.device) -> None:
        """Move this stage to ``device``, with the buffers of :meth:`run_outside`'s modules."""
        self.to(device)
        for module in self.run_outside():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)

    @contextlib.contextmanager
    def _narrowed(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        """The model with only this stage's blocks in its stack, stand-ins for the embeddings it
        does not own, ``x`` fed to its first block; yields the token ids to call the model with."""
        parent_name, _, attr = self._stack_name.rpartition(".")
        parent = self._whole.get_submodule(parent_name)
        stack = parent._modules[attr]
        assert stack is not None
        blocks = list(stack.children())
        hooks, patched = [], []
        ids = x
        if not self._first:
            ids = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
            for name, width in self._stand_ins.items():
                module = self._whole.get_submodule(name)
                module.forward = (lambda w: lambda inp, *a, **k: torch.zeros(  # type: ignore[method-assign]
                    (*inp.shape, w), dtype=x.dtype, device=x.device))(width)
                patched.append(module)
            hooks.append(blocks[self._start].register_forward_pre_hook(
                lambda module, args, kwargs: ((x, *args[1:]), kwargs) if args else
                (args, {**kwargs, "hidden_states": x}), with_kwargs=True))
        if not self._last:
            def cut(module: nn.Module, args: Any, out: Any) -> None:
                raise _Cut(out)
            hooks.append(blocks[self._end - 1].register_forward_hook(cut))
        parent._modules[attr] = type(stack)(blocks[self._start:self._end])  # for this forward only
        try:
            yield ids
        finally:
            parent._modules[attr] = stack
            for h in hooks:
                h.remove()
            for module in patched:
                del module.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._narrowed(x) as ids:
            try:
                out = self._whole(ids)
            except _Cut as cut:
                return output_tensor(cut.hidden)
        return output_tensor(out)

    def sync_shared(self, before: list[torch.Tensor | None]) -> None:
        """Sum the gradient a backward added to each shared parameter (``before``: the gradients
        before it) over the stages that own it, so that every copy steps alike."""
        for (param, group), old in zip(self._shared, before):
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            added = grad - old if old is not None else grad.clone()
            # a stage sharded over its data-parallel ranks (FSDP2) holds a DTensor: each owner's shard
            # is the same slice of the parameter, so the local shards are summed
            dist.all_reduce(local_part(added), group=group)
            param.grad = added if old is None else old + added

    def blocks(self) -> list[nn.Module]:
        """The stack's blocks this stage runs (FSDP2 shards each as a unit)."""
        return list(self._whole.get_submodule(self._stack_name).children())[self._start:self._end]

    def shared_grads(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.detach().clone() for p, _ in self._shared]

    def follow(self, swapped: Any) -> None:
        """The shared parameters after sharding replaced them (``swapped``: a :class:`~.fsdp.ParameterSwap`)."""
        self._shared = [(swapped.lookup(p), group) for p, group in self._shared]
        self._counted_elsewhere = [swapped.lookup(p) for p in self._counted_elsewhere]  # type: ignore[misc]

    def counted_elsewhere(self) -> list[nn.Parameter]:
        """Shared (tied) parameters whose gradient an earlier stage holds too: the whole model's
        gradient norm counts each once, there."""
        return list(self._counted_elsewhere)


def split_stack(model: nn.Module, n_stages: int, rank: int, split_points: Sequence[str] = (),
                distributed: bool = True, replicas: int = 1, replica: int = 0,
                placement: Sequence[int] | None = None) -> list[StackStage] | None:
    """The ``n_stages`` stages of a stack model (None when it has no stack of blocks), and on
    every rank the groups that sum a shared parameter's gradients (a collective when
    ``distributed``: every rank calls it). ``rank`` is this process's place in the pipeline;
    ``placement[s]`` is the pipeline rank that holds stage ``s`` (default: stage ``s`` on rank ``s``; several
    stages a rank: :func:`~paratrain.strategies._stages.stage_ranks`). With ``replicas`` pipelines (data
    parallel), pipeline rank ``q`` of replica ``r`` is global rank ``q * replicas + r``."""
    found = find_stack(model)
    if found is None:
        return None
    stack_name, stack = found
    names = [f"{stack_name}.{child}" for child, _ in stack.named_children()]
    if n_stages > len(names):
        raise NotApplicable(f"pipeline: {n_stages} stages but {type(model).__name__} has {len(names)} blocks in "
                            f"{stack_name}: use at most {len(names)} processes")
    before, after, widths = _probe(model, stack)
    if split_points:
        unknown = [p for p in split_points if p not in names[1:]]
        if unknown or len(split_points) != n_stages - 1:
            raise ValueError(f"pipeline split_points {list(split_points)}: give {n_stages - 1} of the blocks "
                             f"{', '.join(names[1:4])}... (not the first), in order")
        starts = [names.index(p) for p in split_points]
        if starts != sorted(set(starts)):
            raise ValueError(f"pipeline split_points {list(split_points)} must name blocks in forward order")
    else:
        weights = [1 + sum(p.numel() for p in block.parameters()) for block in stack.children()]
        extra = [sum(p.numel() for n in group for p in model.get_submodule(n).parameters(recurse=False))
                 for group in (before, after)]
        weights[0] += extra[0]
        weights[-1] += extra[1]
        starts = balanced_cuts(weights, n_stages)
    bounds = [0, *starts, len(names)]
    stages = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        first, last = i == 0, i == n_stages - 1
        owned = [*(before if first else []), *names[a:b], *(after if last else [])]
        stand_ins = {} if first else {n: widths[n] for n in before if n in widths}
        stages.append(StackStage(model, stack_name, a, b, first, last, owned, stand_ins))
    _share(stages, rank, distributed, replicas, replica, list(placement) if placement else list(range(n_stages)))
    return stages


def _share(stages: list[StackStage], rank: int, distributed: bool, replicas: int, replica: int,
           placement: list[int]) -> None:
    """Parameters owned by stages on several pipeline ranks (tied weights): one process group per set
    of those ranks (in each pipeline replica), made on every rank in the same order. Stages of one rank
    that share a parameter hold the same tensor: autograd sums their gradients."""
    holders: dict[int, list[int]] = {}  # id(parameter) -> the pipeline ranks holding it, in stage order
    params: dict[int, nn.Parameter] = {}
    first_stage: dict[tuple[int, int], int] = {}  # (id(parameter), pipeline rank) -> its first stage there
    for i, stage in enumerate(stages):
        for p in stage.parameters():
            ranks = holders.setdefault(id(p), [])
            if placement[i] not in ranks:
                ranks.append(placement[i])
                first_stage[id(p), placement[i]] = i
            params[id(p)] = p
    for pid, ranks in holders.items():
        if len(ranks) < 2:
            continue
        for r in range(replicas):
            group = dist.new_group([q * replicas + r for q in sorted(ranks)]) if distributed else None
            if rank in ranks and distributed and r == replica:
                stage = stages[first_stage[pid, rank]]
                stage._shared.append((params[pid], group))
                if rank != ranks[0]:
                    stage._counted_elsewhere.append(params[pid])
