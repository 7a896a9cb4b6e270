"""Divergence between two runs: per-tensor relative difference of the final state, and of the loss curve."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["TensorDiff", "Comparison", "compare_runs"]


@dataclass(kw_only=True)
class TensorDiff:
    name: str
    divergence: float
    """``||got - ref|| / ||ref||`` for floating tensors; 0 or inf (differs) for integer buffers."""
    passed: bool
    noise: bool = False
    """Its gradient was rounding noise in the reference run: not counted (see ``compare_runs``)."""


@dataclass(kw_only=True)
class Comparison:
    """One run against the reference run."""

    title: str
    tolerance: float
    tensors: list[TensorDiff] = field(default_factory=list)
    loss_divergence: float | None = None
    """Largest ``|loss - ref_loss| / |ref_loss|`` over the optimizer steps (None: no loss curve)."""
    error: str | None = None
    """Why the comparison could not be made (the run failed, keys differ...)."""
    expected: str | None = None
    """Why this run is expected to differ (then a divergence does not fail verification)."""

    @property
    def worst(self) -> TensorDiff | None:
        return max((t for t in self.tensors if not t.noise), key=lambda t: t.divergence, default=None)

    @property
    def passed(self) -> bool:
        if self.error is not None:
            return False
        loss_ok = self.loss_divergence is None or self.loss_divergence <= self.tolerance
        return loss_ok and all(t.passed for t in self.tensors)


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not ref.is_floating_point():
        return 0.0 if torch.equal(got, ref) else math.inf
    got, ref = got.double(), ref.double()
    scale = ref.norm().item()
    diff = (got - ref).norm().item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def compare_runs(title: str, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tolerance: float,
                 got_losses: list[float] | None = None, ref_losses: list[float] | None = None,
                 noise: set[str] | frozenset[str] = frozenset()) -> Comparison:
    """Compare final states (every tensor of ``ref``) and loss curves (their common steps).

    Tensors in ``noise`` had a gradient of rounding noise only (zero in exact arithmetic): an
    Adam-type optimizer scales that noise to full-size steps whose signs differ between runs, so
    their divergence says nothing about the training and does not fail the comparison."""
    out = Comparison(title=title, tolerance=tolerance)
    missing = sorted(set(ref) - set(got))
    if missing:
        out.error = f"the run has no tensor {missing[0]!r} ({len(missing)} missing)"
        return out
    for name, r in ref.items():
        g = got[name]
        if g.shape != r.shape:
            out.tensors.append(TensorDiff(name=name, divergence=math.inf, passed=False))
            continue
        d = _relative(g, r)
        noisy = name in noise and math.isfinite(d)  # a NaN or inf is never rounding noise
        out.tensors.append(TensorDiff(name=name, divergence=d, passed=d <= tolerance or noisy, noise=noisy))
    if got_losses and ref_losses:
        pairs = list(zip(got_losses, ref_losses))
        # a NaN anywhere in either curve is a divergence (max() would drop it unless it came first)
        out.loss_divergence = max(abs(g - r) / max(abs(r), 1e-12) if math.isfinite(g) and math.isfinite(r)
                                  else (0.0 if g == r else math.inf) for g, r in pairs)
    return out
