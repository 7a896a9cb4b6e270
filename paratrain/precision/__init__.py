"""Precision plugins, chosen by name. Apex opt levels are accepted as aliases.

==========  ==============  ==============================================================
name        alias           what it does
==========  ==============  ==============================================================
``32``      ``O0``          fp32 everywhere (TF32 off)
``tf32``                    fp32 weights, TF32 matmuls on Ampere+ GPUs
``fp16-mixed`` ``O1``, ``16-mixed``  autocast fp16 + dynamic (or static) loss scaling
``bf16-mixed`` ``bf16``     autocast bf16, no scaling needed
``bf16-true``               bf16 weights/activations/gradients, fp32 master weights + optimizer
``fp16-true``  ``O2``, ``O3``  fp16 weights/activations/gradients, fp32 master weights, loss scaling
``fp8-mixed``  ``fp8``      bf16 autocast + torchao's Float8 linears (compute capability 8.9+)
==========  ==============  ==============================================================

Apex's ``O1`` patched functions to run in fp16 where safe: native autocast (``fp16-mixed``) does
that. ``O2`` kept fp16 model weights with fp32 master weights and dynamic loss scaling: that is
``fp16-true``. ``O3`` was pure fp16 without master weights, a speed baseline that often fails
to converge; it maps to ``fp16-true`` too, because paratrain always keeps fp32 master weights
(updates below fp16's resolution would otherwise be lost). Apex itself is deprecated in favour
of these native paths. A common fallback recipe, in
paratrain terms: start with ``fp16-mixed`` and a static ``loss_scale=128``; if it does not converge,
use the dynamic scaler (``loss_scale=None``); if it still does not, use ``bf16-mixed`` (on hardware
with bf16) or ``32``. ``skipped_steps`` tells how often fp16 overflowed.
"""

from __future__ import annotations

from typing import Literal

import torch

from .amp import BF16Mixed, FP16Mixed
from .base import FP32, TF32, Precision, Stepped, computes_in_fp32, fp32_loss
from .fp8 import FP8Mixed
from .half import BF16True, FP16True

__all__ = ["Precision", "FP32", "TF32", "FP16Mixed", "BF16Mixed", "BF16True", "FP16True", "FP8Mixed", "PRECISIONS", "ALIASES",
           "MASTER_WEIGHTS", "resolve", "lookup", "reference", "bench_defaults", "build", "PrecisionName", "Stepped", "fp32_loss",
           "computes_in_fp32"]

PRECISIONS: dict[str, type[Precision]] = {
    "32": FP32,
    "tf32": TF32,
    "fp16-mixed": FP16Mixed,
    "bf16-mixed": BF16Mixed,
    "bf16-true": BF16True,
    "fp16-true": FP16True,
    "fp8-mixed": FP8Mixed,
}
ALIASES = {"O0": "32", "O1": "fp16-mixed", "O2": "fp16-true", "O3": "fp16-true", "16-mixed": "fp16-mixed",
           "fp32": "32", "bf16": "bf16-mixed", "fp16": "fp16-mixed", "16-true": "fp16-true", "fp8": "fp8-mixed"}
# The names and aliases above as a type, for editors' completion of ``Parallel(precision=...)`` (a test
# keeps it equal).
PrecisionName = Literal["32", "tf32", "fp16-mixed", "bf16-mixed", "bf16-true", "fp16-true", "fp8-mixed", "O0", "O1",
                        "O2", "O3", "16-mixed", "fp32", "bf16", "fp16", "16-true", "fp8"]
# low-precision weights + fp32 masters: plain-tensor strategies only
MASTER_WEIGHTS = tuple(name for name, cls in PRECISIONS.items() if cls.master_weights)


def resolve(name: str) -> str:
    """Canonical precision name, or a one-line error listing the choices."""
    name = ALIASES.get(str(name), str(name))
    if name not in PRECISIONS:
        choices = ", ".join([*PRECISIONS, *ALIASES])
        raise ValueError(f"precision {name!r} is unknown: use one of {choices}")
    return name


def lookup(name: str) -> type[Precision]:
    """The precision class called ``name`` (or an alias of it): ask it for its facts
    (``master_weights``, ``scales_loss``, ``param_dtype``...), never compare the name."""
    return PRECISIONS[resolve(name)]


def reference() -> str:
    """Full fp32 (``reference = True``): the default precision, and the one others are compared with."""
    names = [name for name, cls in PRECISIONS.items() if cls.reference]
    if len(names) != 1:
        raise RuntimeError(f"exactly one precision must declare reference; found {names}")
    return names[0]


def bench_defaults(quick: bool = False) -> list[str]:
    """Precisions in paratrain bench's default matrix (``--quick``: the fast subset), registry order."""
    tiers = ("quick",) if quick else ("quick", "full")
    return [name for name, cls in PRECISIONS.items() if cls.bench_default in tiers]


def build(name: str, device: torch.device, loss_scale: float | None = None) -> Precision:
    cls = lookup(name)
    if loss_scale is not None and not cls.scales_loss:
        scaled = " and ".join(n for n, c in PRECISIONS.items() if c.scales_loss)
        raise ValueError(f"a static loss scale ({loss_scale}) only applies to {scaled}, not {name!r}")
    return cls(device, loss_scale) if cls.scales_loss else cls(device)  # type: ignore[call-arg]
