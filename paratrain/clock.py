"""``StepClock``: where a loop stands in its global batch, and when the optimizers really step.

With accumulation ``A`` a global batch is ``A`` micro-steps: each backward is one, and only the
``optimizer.step()`` after the last one steps (earlier calls are no-ops), then clears the
gradients, moves the global step (the data position) on and steps the schedulers paratrain drives.
The clock holds that state and those rules, as Accelerate's ``GradientState`` does; the optimizer
and scheduler wrappers (:mod:`paratrain.wrappers`) consult it, and :class:`~paratrain.Parallel`
gives it the function that applies a step (the strategy's and precision's). It needs no process
group: ``tests/test_clock.py`` plays the rules on it alone.

The rules beside plain accumulation:

* several optimizers stepping after one backward (a parameter group or model each) all step at
  the boundary; the first one ends the global batch and the others follow it;
* several optimizers each after a backward of its own (a GAN's discriminator and generator) end a
  global batch each; the global step moves once per round (when an optimizer ends one again);
* a loop's own ``GradScaler`` that finds inf/NaN gradients ends the global batch as a skipped step;
* a learning rate moved between the micro-steps of one global batch (a scheduler stepped per
  micro-batch) is reported once.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch

from .data.stream import StreamState
from .precision.base import Stepped
from .trace.recorder import set_position

__all__ = ["StepClock", "GradientWatch", "ClockCount"]

# How a step is applied: (the real optimizer, whether this step ends the global batch) -> weights changed.
# False for an optimizer that steps after the one that ended the global batch, on the same gradients.
Apply = Callable[[torch.optim.Optimizer, bool], "bool | Stepped"]


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

    def check(self, accumulation: int, micro_step: int, stacklevel: int = 3) -> None:
        seen, self._seen = self._seen, []
        if self.warned or not any(p.grad is not g or g._version != v for p, g, v in seen):
            return
        self.warned = True
        warnings.warn(
            f"gradients changed between micro-batches {micro_step} and {micro_step + 1} of a global batch "
            f"(accumulation {accumulation}): a clip_grad_norm_ or zero_grad in the loop body acted on partial "
            "gradients, so the result depends on the accumulation and world size; clip with "
            "Parallel(clip_grad_norm=...), or only when pt.micro_step == pt.accumulation", stacklevel=stacklevel)


class ClockCount:
    """A count the owner's ``_clock`` keeps (``Parallel.global_step``, ``micro_step``), read and set
    through the owner: the clock is its one owner."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> int:
        return self if obj is None else getattr(obj._clock, self.name)  # type: ignore[return-value]

    def __set__(self, obj: Any, value: int) -> None:
        setattr(obj._clock, self.name, value)


class StepClock:
    """The micro-step, global step and step rules of one run (see the module's docstring).

    ``apply(optimizer, ends_batch)`` steps the real ``optimizer`` and says whether its weights
    changed. ``optimizers`` are the real optimizers (for the lr check), ``schedulers`` those a
    checkpoint holds by default.
    """

    def __init__(self, accumulation: int, apply: Apply) -> None:
        self.accumulation = accumulation
        self.apply = apply
        self.global_step = 0
        self.micro_step = 0
        self.scaler_skips = 0  # global batches the loop's own GradScaler skipped (see scaled_step)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[Any] = []
        self._driven: list[tuple[Any, torch.optim.Optimizer]] = []  # schedulers stepped here, with their optimizer
        self._followed: dict[int, int] = {}  # id(a scheduler wrapper) -> the global step it last acted on
        # Several optimizers: those that stepped since the last backward, those whose step() came
        # before their global batch ended, and those that ended one in this global step.
        self._since_backward: list[torch.optim.Optimizer] = []
        self._early: list[torch.optim.Optimizer] = []
        self._ended: list[torch.optim.Optimizer] = []
        self._lrs_at_start: list[float] | None = None
        self._warned_lr_change = False
        self._watching = False
        self.watch = GradientWatch()  # gradients edited mid-accumulation (a clip in the loop body)
        self.stream = StreamState()  # the stream the position counts in: a checkpoint keeps its identity
        set_position(self.position)  # the newest clock: each collective's record names its step (paratrain.trace)

    # --- where the global batch stands ---------------------------------------------------
    def position(self) -> tuple[int, int]:
        """``(global step, micro-step)``: what each collective's record says (:mod:`paratrain.trace`)."""
        return self.global_step, self.micro_step

    @property
    def last_micro_step(self) -> bool:
        """Is the coming backward the global batch's last (the one whose gradients are all-reduced)?"""
        return self.micro_step == self.accumulation - 1

    def restore(self, global_step: int) -> None:
        """Continue from ``global_step`` (a checkpoint's), at a global batch's start; the
        schedulers that follow the optimizer steps last acted on that step."""
        self.global_step, self.micro_step = int(global_step), 0
        self._followed = dict.fromkeys(self._followed, self.global_step)

    # --- backward ------------------------------------------------------------------------
    def backward(self, run: Callable[[int], None], params: Callable[[], Iterable[torch.Tensor]] | None = None) -> None:
        """One micro-step's backward: ``run(divisor)`` runs it, its losses divided by ``divisor``
        (the accumulation). ``params``: the parameters whose gradients must not change between
        micro-steps (None: not watched)."""
        if self.micro_step >= self.accumulation:
            raise RuntimeError(
                f"backward called {self.micro_step + 1} times without an optimizer step, but accumulation "
                f"is {self.accumulation}: call optimizer.step() once per micro-batch"
            )
        if self.micro_step == 0 and self.accumulation > 1:
            self._lrs_at_start = self._current_lrs()
        self._since_backward = []
        watch = params is not None and self.accumulation > 1
        if watch and self.micro_step > 0:
            self.watch.check(self.accumulation, self.micro_step, stacklevel=4)
        run(self.accumulation)
        if watch and not self.last_micro_step:
            self.watch.record(params())  # type: ignore[misc]
        self.micro_step += 1

    # --- the step ------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer) -> bool | Stepped:
        """``optimizer.step()`` as the loop calls it: a step at the end of a global batch (a no-op
        on earlier micro-steps). True if the weights changed."""
        if self.micro_step < self.accumulation:
            if self.micro_step == 0 and self._since_backward and optimizer not in self._since_backward:
                return self._step_another(optimizer)
            if self.micro_step > 0 and optimizer not in self._early:
                self._early.append(optimizer)
            return False
        if self._early and optimizer not in self._early:
            raise ValueError(
                f"two optimizers step after backward calls of their own (a GAN-style loop) with accumulation "
                f"{self.accumulation}: the one that stepped first would never step; use accumulation 1 "
                "(a larger micro-batch), or one optimizer for both losses")
        self._check_lr_unchanged()
        stepped = self.apply(optimizer, True)
        self._end_global_batch(optimizer)
        return stepped

    def scaled_step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, grad_scale: Any) -> bool | Stepped:
        """:meth:`step` as the loop's own ``torch.amp.GradScaler`` drives it: ``found_inf`` set ends
        the global batch as a skipped step; else the gradients are unscaled by ``grad_scale`` (None:
        the loop unscaled them itself) and the optimizer steps."""
        if self.accumulation > 1:
            raise ValueError(
                f"your own GradScaler with accumulation {self.accumulation}: its step() and update() every "
                "micro-batch would unscale and rescale gradients in the middle of a global batch; drop it and "
                "use Parallel(precision='fp16-mixed'), which scales the loss and skips overflow steps per global batch")
        if self.micro_step < self.accumulation:
            return False
        if bool(found_inf.item()):
            self.scaler_skips += 1
            self._end_global_batch(optimizer)
            return False
        if grad_scale is not None:
            inv = 1.0 / grad_scale.double()
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv.to(device=p.grad.device, dtype=p.grad.dtype))
        return self.step(optimizer)

    def _end_global_batch(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step of a global batch (taken or skipped): gradients cleared, the
        data position one step on, and the schedulers driven for ``optimizer`` stepped.

        With several optimizers that each end a batch of their own (a GAN), the global step (the
        data position) moves once per round: when an optimizer ends a batch again."""
        self._after_step(optimizer)
        self.micro_step = 0
        self._early = []
        self._since_backward = [optimizer]
        if not self._ended or optimizer in self._ended:
            self.global_step += 1
            self._ended = []
        self._ended.append(optimizer)

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        for scheduler, owner in self._driven:
            if owner is optimizer:
                scheduler.step()

    def _step_another(self, optimizer: torch.optim.Optimizer) -> bool | Stepped:
        """The step of a second optimizer after the same backward as the one that ended the global
        batch: its gradients are complete (and clipped with the others' by that step)."""
        stepped = self.apply(optimizer, False)
        self._after_step(optimizer)
        self._since_backward.append(optimizer)
        return stepped

    # --- schedulers ----------------------------------------------------------------------
    def drive(self, scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
        """Step ``scheduler`` after every step of the real ``optimizer`` (``register_scheduler``)."""
        self.unfollow(scheduler)  # one built on the optimizer wrapper followed its steps by itself until now
        self._driven.append((scheduler, optimizer))
        self.schedulers.append(scheduler)

    def follow(self, wrapper: Any) -> None:
        """A scheduler wrapper whose ``step()`` acts once per optimizer step (:meth:`due`)."""
        self._followed[id(wrapper)] = self.global_step
        self.schedulers.append(wrapper)

    def unfollow(self, wrapper: Any) -> None:
        """``wrapper`` no longer follows the optimizer steps by itself (it was set up or is driven)."""
        self._followed.pop(id(wrapper), None)
        self.schedulers = [s for s in self.schedulers if s is not wrapper]

    def following(self, wrapper: Any) -> bool:
        """Whether ``wrapper`` steps once per optimizer step by asking :meth:`due`."""
        return id(wrapper) in self._followed

    def due(self, wrapper: Any) -> bool:
        """Whether the optimizers stepped since ``wrapper`` last acted; if so it acts now."""
        last = self._followed.setdefault(id(wrapper), self.global_step)
        if self.global_step <= last:
            return False  # no optimizer step since its last step: mid-accumulation
        self._followed[id(wrapper)] = self.global_step
        return True

    def checkpointed(self, scheduler: Any = None) -> Any:
        """The scheduler a checkpoint holds: ``scheduler``, else the one set up (or driven), if one."""
        if scheduler is not None or not self.schedulers:
            return scheduler
        if len(self.schedulers) > 1:
            raise ValueError(f"{len(self.schedulers)} schedulers were set up: pass the one to checkpoint as scheduler=")
        return self.schedulers[0]

    def _current_lrs(self) -> list[float]:
        return [float(g["lr"]) for opt in self.optimizers for g in opt.param_groups if "lr" in g]

    def _check_lr_unchanged(self) -> None:
        """Warn once when the lr moved between the micro-steps of one global batch: a scheduler
        stepped per micro-batch instead of per optimizer step."""
        if self._lrs_at_start is not None and not self._warned_lr_change and self._current_lrs() != self._lrs_at_start:
            self._warned_lr_change = True
            warnings.warn("the learning rate changed in the middle of an accumulation: a scheduler steps per "
                          "micro-batch; pass it to pt.setup(model, optimizer, scheduler) or pt.register_scheduler",
                          stacklevel=4)
        self._lrs_at_start = None
