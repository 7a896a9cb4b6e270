"""What :meth:`Parallel.setup <paratrain.Parallel.setup>` returns: the module, optimizer and
scheduler wrappers, in one file (as Lightning Fabric's ``wrappers.py``).

``ParallelModule`` runs the strategy's wrapper under the precision's autocast with the user's
``state_dict`` keys; ``ParallelOptimizer`` is a real :class:`torch.optim.Optimizer` (schedulers
accept it) whose ``step`` acts once per global batch; ``ParallelScheduler`` steps once per
optimizer step, so a loop that steps both per micro-batch keeps the schedule it has without
accumulation; so does a torch LR scheduler built on the returned optimizer without being given to
``setup`` (:func:`follow_steps`). The optimizer and scheduler ask the run's
:class:`~paratrain.clock.StepClock` where the global batch stands.
"""

from __future__ import annotations

import functools

import sys
from typing import Any, Callable

import torch
from torch import nn

from .clock import StepClock
from .evaluation import to_float32
from .precision import Precision
from .precision.base import Stepped

__all__ = ["ParallelModule", "ParallelOptimizer", "ParallelScheduler", "attach_scheduler", "follow_steps",
           "registered_optimizer", "strategy_module", "checkpointed", "compiled_like", "is_compiled", "uncompiled",
           "unwrapped"]


def attach_scheduler(scheduler: Any, optimizer: ParallelOptimizer) -> Any:
    """Point ``scheduler`` (and those a SequentialLR/ChainedScheduler holds) at ``optimizer``; one
    built on it, which followed its steps by itself (:func:`follow_steps`), is now set up or driven."""
    for s in (scheduler, *getattr(scheduler, "_schedulers", ())):
        _unfollow(s, optimizer._clock)
        if hasattr(s, "optimizer"):
            s.optimizer = optimizer
    return scheduler


class _FollowsSteps:
    """What a torch LR scheduler built on a :class:`ParallelOptimizer` (not given to ``setup``)
    becomes: its ``step()`` acts once per optimizer step, as a scheduler passed to ``setup`` does,
    instead of once per micro-batch. The steps of its construction run as they are."""

    _plain: type = object  # the scheduler's own class

    def step(self, *args: Any, **kwargs: Any) -> None:
        clock = self.optimizer._clock  # type: ignore[attr-defined]
        if "_last_lr" not in self.__dict__ or not clock.following(self) or clock.due(self):
            super().step(*args, **kwargs)  # type: ignore[misc]

    def __reduce_ex__(self, protocol: Any) -> Any:  # a copy (deepcopy, pickle) is the plain scheduler
        reduced: Any = super().__reduce_ex__(protocol)
        return (reduced[0], tuple(self._plain if a is type(self) else a for a in reduced[1]), *reduced[2:])


_FOLLOWING: dict[type, type] = {}  # a scheduler class -> its _FollowsSteps subclass


def follow_steps(scheduler: Any, optimizer: ParallelOptimizer) -> None:
    """Make ``scheduler`` (a torch LR scheduler being built on ``optimizer``, not yet given to
    ``setup`` or ``register_scheduler``) step once per optimizer step (:class:`_FollowsSteps`); the
    schedulers a SequentialLR or ChainedScheduler holds are then stepped by it."""
    if isinstance(scheduler, _FollowsSteps) or not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) \
            or getattr(scheduler, "optimizer", None) is not optimizer:
        return
    plain = type(scheduler)
    if plain not in _FOLLOWING:
        names = {"_plain": plain, "__module__": plain.__module__, "__qualname__": plain.__qualname__}
        _FOLLOWING[plain] = type(plain.__name__, (_FollowsSteps, plain), names)
    scheduler.__class__ = _FOLLOWING[plain]
    optimizer._clock.follow(scheduler)
    for inner in getattr(scheduler, "_schedulers", ()):
        _unfollow(inner, optimizer._clock)


def _unfollow(scheduler: Any, clock: StepClock) -> None:
    if isinstance(scheduler, _FollowsSteps):
        scheduler.__class__ = scheduler._plain
        clock.unfollow(scheduler)


def registered_optimizer(scheduler: Any, optimizer: ParallelOptimizer | None) -> ParallelOptimizer:
    """The optimizer a scheduler given to ``register_scheduler`` follows, or a one-line error."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("register_scheduler: ReduceLROnPlateau steps on a metric that paratrain does not have: "
                         "pass it to pt.setup(model, optimizer, scheduler) and call scheduler.step(metric) yourself")
    if optimizer is None:
        optimizer = getattr(scheduler, "optimizer", None)
        if not isinstance(optimizer, ParallelOptimizer):
            raise ValueError("register_scheduler: build the scheduler on the optimizer pt.setup returned, "
                             "or pass that optimizer: pt.register_scheduler(scheduler, optimizer)")
    return optimizer


def strategy_module(model: Any, models: list[nn.Module]) -> nn.Module:
    """What the strategy made of ``model`` (a module ``setup`` returned; None: the last one set up),
    one of ``models``, for another optimizer of it (``setup_optimizer``); else a one-line error."""
    if not models:
        raise ValueError("setup_optimizer: set the model up first, model = pt.setup(model)")
    wrapped = models[-1] if model is None else getattr(model, "_strategy_module", None)
    if wrapped is None or not any(wrapped is m for m in models):
        raise ValueError("setup_optimizer: pass the model pt.setup returned (or none: the last one set up)")
    return wrapped


def checkpointed(model: nn.Module, optimizer: Any, unwrap: Callable[[nn.Module], nn.Module]) -> tuple[nn.Module, Any]:
    """The module and the plain optimizer that this rank checkpoints, of what ``setup`` returned."""
    model = uncompiled(model)
    module = model.checkpointed_module() if isinstance(model, ParallelModule) else unwrap(model)
    return module, getattr(optimizer, "optimizer", optimizer)


def compiled_like(compiled: Any, wrapped: nn.Module, compile: bool, backend: str) -> nn.Module:
    """What forward runs: the strategy's ``wrapped`` module compiled as the user's ``compiled`` model
    was (the same compilation around it), or by ``torch.compile`` when the config asks, else itself."""
    if compiled is not None:
        return type(compiled)(wrapped, compiled.dynamo_ctx)
    return torch.compile(wrapped, backend=backend) if compile else wrapped  # type: ignore[return-value]


def unwrapped(model: nn.Module, strategy_unwrap: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """The user's module inside ``model``: what ``setup`` returned, the strategy's wrapper (taken off
    by ``strategy_unwrap``), or either compiled."""
    model = uncompiled(model)
    if isinstance(model, ParallelModule):
        return model.original
    return uncompiled(strategy_unwrap(model))


def is_compiled(model: Any) -> bool:
    """Is ``model`` ``torch.compile``'s wrapper? (torch._dynamo is loaded once anything was compiled:
    no import here, which would cost seconds in every process.)"""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def uncompiled(model: Any) -> Any:
    """``model`` without ``torch.compile``'s wrapper (whose state_dict keys start with ``_orig_mod.``)."""
    while is_compiled(model):
        model = model._orig_mod
    return model


class ParallelModule(nn.Module):
    """What :meth:`Parallel.setup` returns: the strategy's wrapper (DDP...) with forward run
    under the precision's autocast and floating outputs returned in fp32 (losses are computed
    outside the model), unless the call itself is made under autocast (:meth:`Parallel.autocast`). ``state_dict``/``load_state_dict`` are the user's module's, so
    checkpoints have the user's keys whatever the strategy, and so is ``.module`` (as Lightning
    Fabric's): a DDP script's ``model.module.state_dict()`` or ``model.module.save_pretrained(...)``
    means the same at every world size (under fsdp/tensor that module holds sharded parameters:
    use :meth:`Parallel.full_state_dict`).
    """

    def __init__(self, wrapped: nn.Module, original: nn.Module, precision: Precision,
                 before_forward: Callable[[nn.Module], None], after_load: Callable[[nn.Module], None],
                 strategy_module: nn.Module | None = None, checkpointed: nn.Module | None = None) -> None:
        super().__init__()
        self._forward_module = wrapped  # what forward runs: the strategy's wrapper, compiled if asked
        object.__setattr__(self, "original", original)  # not a submodule: no duplicate keys
        object.__setattr__(self, "_strategy_module", wrapped if strategy_module is None else strategy_module)
        object.__setattr__(self, "_checkpointed", original if checkpointed is None else checkpointed)
        object.__setattr__(self, "_precision", precision)
        object.__setattr__(self, "_before_forward", before_forward)
        object.__setattr__(self, "_after_load", after_load)

    @property
    def module(self) -> nn.Module:
        """The user's module (not DDP or another strategy wrapper, whatever the world size)."""
        return self.__dict__["original"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._before_forward(self._strategy_module)
        return self._autocast(self._forward_module, *args, **kwargs)

    def _autocast(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``method`` under the precision's autocast. Its floating outputs come back in fp32 for a loss
        computed outside autocast; a call made under autocast already (``with pt.autocast():``, as
        nanoGPT's ``with ctx:`` around forward and loss) gets them as autocast made them, as plain
        PyTorch does: the loss's own autocast then reads the bf16 logits straight into fp32
        (``log_softmax(x, dtype=float32)``) with no fp32 copy of them in between (on GPT-2 124M on an H200
        the copy and the fp32 ``log_softmax`` it fed took 1.9 ms of a 21 ms step)."""
        if not self._precision.autocast:
            return method(*args, **kwargs)
        caller_autocast = torch.is_autocast_enabled(self._precision.device.type)
        with self._precision.forward_context():
            out = method(*args, **kwargs)
        return out if caller_autocast else to_float32(out)

    def checkpointed_module(self) -> nn.Module:
        """The module whose parameters this rank holds and checkpoints (a pipeline's stage, the
        user's module otherwise); what :mod:`paratrain.checkpoint` saves and loads."""
        return self._checkpointed

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.original.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the user's module; fp32 master weights and a parameter server's copy follow."""
        result = self.original.load_state_dict(state_dict, strict=strict, assign=assign)
        self._after_load(self.original)
        return result

    def mark_forward_method(self, name: str) -> None:
        """Run ``self.<name>(...)`` as :meth:`forward` runs: before-forward bookkeeping, the
        precision's autocast, fp32 floating outputs outside autocast (see :meth:`Parallel.mark_forward_method`)."""
        method = getattr(self.__dict__["original"], name, None)
        if not callable(method):
            raise ValueError(f"mark_forward_method: {type(self.original).__name__} has no method {name!r}")
        self.__dict__.setdefault("_forward_methods", set()).add(name)

    def _run_marked(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._before_forward(self._strategy_module)
        return self._autocast(method, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            attr = getattr(self.__dict__["original"], name)  # the user's own attributes
            if name in self.__dict__.get("_forward_methods", ()):
                return functools.partial(self._run_marked, attr)
            return attr


class ParallelOptimizer(torch.optim.Optimizer):
    """The user's optimizer, with ``step``/``zero_grad`` aware of accumulation and loss scaling.

    A real :class:`torch.optim.Optimizer` (so any ``torch.optim.lr_scheduler`` accepts it) whose
    ``param_groups``, ``state`` and ``defaults`` *are* the wrapped optimizer's: a scheduler's lr
    lands in the optimizer that steps. ``Optimizer.__init__`` is not called: there is nothing of
    its own to build. ``step`` is marked the way an LR scheduler marks the ``step`` it wraps, so
    the scheduler leaves it alone, and ``_opt_called`` tells it the optimizer stepped first.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, clock: StepClock) -> None:
        self.optimizer = optimizer
        self._clock = clock
        self._opt_called = False

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        caller: Any = sys._getframe(1)
        for _ in range(3):  # a torch LR scheduler being built on this optimizer reads them (or a helper of its)
            if caller is None or caller.f_code.co_name == "__init__":
                follow_steps(caller and caller.f_locals.get("self"), self)
                break
            caller = caller.f_back
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    # torch.amp.GradScaler.step(optimizer) then always calls step(), with found_inf and grad_scale set
    # on the optimizer, instead of unscaling and calling step() only when no gradient overflowed: so
    # a step it skips still ends the global batch (StepClock.scaled_step).
    _step_supports_amp_scaling = True

    def step(self, closure: Any = None) -> bool | Stepped:  # type: ignore[override]
        """Step at the end of a global batch (a no-op on earlier micro-steps). True if weights changed."""
        if closure is not None:
            raise ValueError("closures are not supported by paratrain's optimizer step: compute the loss in the loop")
        self._opt_called = True
        found_inf = self.__dict__.get("found_inf")  # set by a GradScaler of the loop's own for this call
        if found_inf is not None:
            return self._clock.scaled_step(self.optimizer, found_inf, self.__dict__.get("grad_scale"))
        return self._clock.step(self.optimizer)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # torch.optim.lr_scheduler: "already counts its calls"

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._clock.micro_step == 0:  # never wipe gradients mid-accumulation
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Any:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    # Hooks belong to the optimizer that really steps: they fire once per global batch.
    def register_step_pre_hook(self, hook: Any) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ParallelOptimizer({self.optimizer!r})"

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)


class ParallelScheduler:
    """The user's LR scheduler, as :meth:`Parallel.setup` returns it: ``step()`` acts once per
    real optimizer step, so a loop that calls it after every ``optimizer.step()`` — once per
    micro-batch under accumulation — or once per epoch gets the schedule it would get without
    accumulation. Everything else (``get_last_lr``, ``state_dict``...) is the scheduler's.
    """

    def __init__(self, scheduler: Any, clock: StepClock) -> None:
        for s in (scheduler, *getattr(scheduler, "_schedulers", ())):
            _unfollow(s, clock)  # this wrapper follows the steps for it
        self.scheduler = scheduler
        self._clock = clock
        clock.follow(self)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._clock.due(self):
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> Any:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
