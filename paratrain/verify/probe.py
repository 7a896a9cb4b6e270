"""What ``paratrain verify`` observes inside a training run, without touching the training code.

Process-wide hooks, installed in the fresh worker process before the job builds anything:

* a global module forward pre-hook sees every *outermost* training-mode forward (the model as the
  loop calls it, e.g. the DDP wrapper) and records its batch: how many samples, and one fingerprint
  per sample (a fixed random projection of the input), so the samples of every optimizer step can
  be compared across world sizes as a multiset;
* a global optimizer step pre-hook on the main thread closes an optimizer step: samples and fingerprints since the
  previous step, the learning rate, and at the first step which parameters got no gradient and a
  checksum of the initial weights.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from ..dtensors import local_part

__all__ = ["Probe", "clean_name"]

_PREFIXES = ("module.", "_forward_module.", "original.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter name without the wrapper prefixes (DDP's ``module.``, torch.compile's ...)."""
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


class Probe:
    """Records per optimizer step: samples seen by this rank, their fingerprints and the lr."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.unused: list[str] | None = None
        self.init_checksum: float | None = None
        self.grad_norms: dict[str, float] = {}  # per parameter, the largest local gradient norm at a step
        self.root: nn.Module | None = None
        self._depth = 0
        self._samples = 0
        self._fingerprints: list[float] = []
        self._weights: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []
        self.count_forwards = True
        """Count samples at the outermost forward (user scripts); paratrain's own runs instead
        report each rank's micro-batches with :meth:`record_batch`."""

    # --- hooks -----------------------------------------------------------------------------
    def install(self) -> "Probe":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._handles = [
            register_module_forward_pre_hook(self._pre_forward),
            register_module_forward_hook(self._post_forward, with_kwargs=True, always_call=True),
            register_optimizer_step_pre_hook(self._pre_step),
        ]
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._depth += 1

    @staticmethod
    def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The batch's inputs: the first positional tensor, or the first keyword tensor that is not
        the labels (``model(**batch)``: ``input_ids``, ``pixel_values``...)."""
        if args:
            return args[0] if isinstance(args[0], torch.Tensor) else None
        return next((v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in ("labels", "label")),
                    None)

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      output: Any = None) -> None:  # torch passes no output when the forward raised
        # The outermost forward (depth 1) of a training step: seen here, where keyword inputs are too.
        if self._depth == 1 and module.training and torch.is_grad_enabled():
            x = self._inputs(args, kwargs)
            if x is not None and x.dim() > 0:
                if self.root is None:
                    self.root = module
                if self.count_forwards:
                    self.record_batch(x)
        self._depth = max(0, self._depth - 1)

    def record_batch(self, x: torch.Tensor) -> None:
        """Count ``x`` (one micro-batch of inputs) towards the current optimizer step."""
        self._samples += int(x.shape[0])
        self._fingerprints += self._fingerprint(x).tolist()

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # not the training loop (the ps server steps its own optimizer in RPC threads)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        names = self._names()
        if not self.steps:
            self.unused = [names.get(id(p), f"param[{i}]") for i, p in enumerate(params)
                           if p.requires_grad and p.grad is None]
            with torch.no_grad():
                self.init_checksum = float(sum(local_part(p).double().sum().item() for p in params))
        with torch.no_grad():
            for i, p in enumerate(params):
                if p.grad is not None:
                    name = names.get(id(p), f"param[{i}]")
                    norm = float(local_part(p.grad).double().norm().item())
                    self.grad_norms[name] = max(norm, self.grad_norms.get(name, 0.0))
        self.steps.append({"samples": self._samples, "fingerprints": sorted(self._fingerprints),
                           "lr": float(optimizer.param_groups[0]["lr"])})
        self._samples, self._fingerprints = 0, []

    # --- helpers ---------------------------------------------------------------------------
    def _fingerprint(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(x.shape[0], -1).to("cpu", torch.float64)
        n = flat.shape[1]
        if n not in self._weights:
            self._weights[n] = torch.randn(n, generator=torch.Generator().manual_seed(1234), dtype=torch.float64)
        return flat @ self._weights[n]

    def _names(self) -> dict[int, str]:
        if self.root is None:
            return {}
        return {id(p): clean_name(n) for n, p in self.root.named_parameters()}

    def summary(self) -> dict[str, Any]:
        return {"steps": self.steps, "unused": self.unused, "init_checksum": self.init_checksum,
                "grad_norms": self.grad_norms}

