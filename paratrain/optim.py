"""The user's optimizer and LR scheduler as :meth:`Parallel.setup <paratrain.Parallel.setup>` returns them.

``ParallelOptimizer`` is a real :class:`torch.optim.Optimizer` (schedulers accept it) whose
``step`` acts once per global batch; ``ParallelScheduler`` steps once per optimizer step, so a
loop that steps both per micro-batch keeps the schedule it has without accumulation.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Protocol

import torch

__all__ = ["ParallelOptimizer", "ParallelScheduler", "GradientWatch"]


class GradientWatch:
    """Notices gradients changed *between* the micro-steps of one global batch.

    With accumulation, the gradients between two ``backward`` calls are partial sums: a
    ``clip_grad_norm_`` (or ``model.zero_grad()``, or any in-place edit) there acts on a part of the
    global batch, so the result depends on the accumulation and hence on the world size. After
    each backward but the last the watch records every gradient's tensor and version counter
    (in-place edits bump it); the next backward compares. Reported once, as a warning.
    """

    def __init__(self) -> None:
        self._seen: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.warned = False

    def record(self, params: Iterable[torch.Tensor]) -> None:
        if not self.warned:
            self._seen = [(p, p.grad, p.grad._version) for p in params if p.grad is not None]

    def check(self, accumulation: int, micro_step: int) -> None:
        seen, self._seen = self._seen, []
        if self.warned or not any(p.grad is not g or g._version != v for p, g, v in seen):
            return
        self.warned = True
        warnings.warn(
            f"gradients changed between micro-batches {micro_step} and {micro_step + 1} of a global batch "
            f"(accumulation {accumulation}): a clip_grad_norm_ or zero_grad in the loop body acted on partial "
            "gradients, so the result depends on the accumulation and world size; clip with "
            "Parallel(clip_grad_norm=...), or only when pt.micro_step == pt.accumulation", stacklevel=3)


class Runtime(Protocol):
    """What the wrappers need of :class:`~paratrain.Parallel`: where the accumulation stands."""

    micro_step: int
    global_step: int

    def step(self, optimizer: Any) -> bool: ...

    def scaled_step(self, optimizer: Any, found_inf: torch.Tensor, grad_scale: Any) -> bool: ...


class ParallelOptimizer(torch.optim.Optimizer):
    """The user's optimizer, with ``step``/``zero_grad`` aware of accumulation and loss scaling.

    A real :class:`torch.optim.Optimizer` (so any ``torch.optim.lr_scheduler`` accepts it) whose
    ``param_groups``, ``state`` and ``defaults`` *are* the wrapped optimizer's: a scheduler's lr
    lands in the optimizer that steps. ``Optimizer.__init__`` is not called: there is nothing of
    its own to build. ``step`` is marked the way an LR scheduler marks the ``step`` it wraps, so
    the scheduler leaves it alone, and ``_opt_called`` tells it the optimizer stepped first.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: Runtime) -> None:
        self.optimizer = optimizer
        self._runtime = runtime
        self._opt_called = False

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
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
    # a step it skips still ends the global batch (Parallel.scaled_step).
    _step_supports_amp_scaling = True

    def step(self, closure: Any = None) -> bool:  # type: ignore[override]
        """Step at the end of a global batch (a no-op on earlier micro-steps). True if weights changed."""
        if closure is not None:
            raise ValueError("closures are not supported by paratrain's optimizer step: compute the loss in the loop")
        self._opt_called = True
        found_inf = self.__dict__.get("found_inf")  # set by a GradScaler of the loop's own for this call
        if found_inf is not None:
            return self._runtime.scaled_step(self, found_inf, self.__dict__.get("grad_scale"))
        return self._runtime.step(self)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # torch.optim.lr_scheduler: "already counts its calls"

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._runtime.micro_step == 0:  # never wipe gradients mid-accumulation
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

    def __init__(self, scheduler: Any, runtime: Runtime) -> None:
        self.scheduler = scheduler
        self._runtime = runtime
        self._stepped_at = runtime.global_step

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._runtime.global_step <= self._stepped_at:
            return  # no optimizer step since the last scheduler step: mid-accumulation
        self._stepped_at = self._runtime.global_step
        self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> Any:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
