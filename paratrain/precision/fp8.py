"""fp8 training (``fp8-mixed``): torchao's Float8 training under bf16 autocast.

:func:`torchao.float8.convert_to_float8_training` swaps the model's ``nn.Linear`` layers for
``Float8Linear``, whose matmuls (forward and both gradients) run in float8 with dynamic per-tensor
scales, on the tensor cores of compute capability 8.9 and newer (Ada, Hopper, Blackwell); the rest
of the model computes in bf16 under autocast, weights and optimizer stay fp32, as in ``bf16-mixed``.
This is how torchtitan trains Llama-3 with Float8. A layer is converted where both its sizes are
multiples of 16 (what the float8 matmul takes) and it is not the output head (torchtitan leaves the
head in bf16 too). ``torch.compile`` (``compile=True``) fuses the casts: without it fp8 is slower
than bf16.

Anywhere else (no CUDA, an older GPU, torchao missing) the precision is refused in one line that
says what to use, before any process starts its training.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import ClassVar

import torch
from torch import nn

from ..env.process import is_main_process
from .amp import BF16Mixed

__all__ = ["FP8Mixed", "MIN_CAPABILITY", "PAYS_FROM", "float8_unsupported", "float8_filter"]

MIN_CAPABILITY = (8, 9)
"""The first compute capability with float8 tensor cores (Ada; Hopper is 9.0)."""
PAYS_FROM = 4096
"""Below this width (the smaller of a linear's two sizes, the widest over the converted linears) fp8 was slower
than bf16: GPT-2 124M's 768x3072 linears ran 0.71-0.78x on an H200 (docs/selftest.md); torchtitan's
Float8 gains are on Llama-3 8B's 4096-wide layers."""
HEAD_NAMES = ("lm_head", "output", "head", "classifier")
"""The last name of a model's output layer as the common models spell it: left in bf16."""


def float8_unsupported(device: torch.device) -> str | None:
    """Why fp8-mixed cannot run on ``device`` here (one line naming what to do), or None."""
    if device.type != "cuda" or torch.version.hip is not None:  # ROCm's capability numbers are not CUDA's
        where = "ROCm" if device.type == "cuda" else device.type
        return (f"precision fp8-mixed needs a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                f"or newer (Ada, Hopper, Blackwell), and this run is on {where}: use bf16-mixed")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        return (f"precision fp8-mixed needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer, and "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: use bf16-mixed")
    if importlib.util.find_spec("torchao") is None:
        return "precision fp8-mixed needs torchao (its Float8 training): pip install 'paratrain[fp8]'"
    return None


def float8_filter(module: nn.Module, fqn: str) -> bool:
    """Which layers become ``Float8Linear``: an ``nn.Linear`` whose in and out sizes are multiples of
    16, except the output head (``lm_head``, ``output``...)."""
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] in HEAD_NAMES:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


class FP8Mixed(BF16Mixed):
    """bf16 autocast with torchao's Float8 linears (see the module's text)."""

    name = "fp8-mixed"
    float8: ClassVar[bool] = True
    bench_default = "no"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        why = self.unsupported(device)
        if why is not None:
            raise ValueError(why)

    @classmethod
    def unsupported(cls, device: torch.device) -> str | None:
        return float8_unsupported(device)

    def setup_model(self, model: nn.Module) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        # pad_inner_dim: the weight gradient's inner size is the number of tokens of the micro-batch, which
        # torch._scaled_mm wants a multiple of 16 (a short last batch, an odd sequence length): padded
        config = Float8LinearConfig(pad_inner_dim=True)
        model = convert_to_float8_training(model, module_filter_fn=float8_filter, config=config)
        converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
        if not converted:
            raise ValueError("precision fp8-mixed found no nn.Linear with both sizes a multiple of 16 in the model "
                             "(the output head stays bf16): nothing would train in fp8; use bf16-mixed")
        widest = max(min(m.in_features, m.out_features) for m in converted)  # a matmul is as narrow as its narrower side
        if widest < PAYS_FROM and is_main_process():
            warnings.warn(f"precision fp8-mixed: the widest float8 linear is {widest} wide; below about {PAYS_FROM} the "
                          "float8 casts cost more than the float8 matmuls save (GPT-2 124M, 768 wide, ran 0.71-0.78x "
                          "of bf16-mixed on an H200): bf16-mixed is faster for this model", stacklevel=2)
        return model
