"""Build a model by name for a dataset's input shape and number of classes."""

from __future__ import annotations

import inspect
import math

from torch import nn

from .gpt import GPT, GPTConfig
from .mlp import MLP
from .resnet import ResNet50, SmallCNN, resnet_cifar
from ..userfn import is_user_spec, load_callable
from .transformer import TinyTransformer

__all__ = ["MODEL_NAMES", "build_model"]

#: The built-in model names (``"torchvision:<name>"`` is accepted too when torchvision is installed).
MODEL_NAMES: tuple[str, ...] = ("mlp", "cnn", "resnet8", "resnet20", "resnet50", "transformer", "gpt", "gpt2")

_TORCHVISION_MISSING = (
    "torchvision is not installed: pip install 'paratrain[data]' (torchvision matching your torch, e.g. "
    "torch==2.14.1 torchvision==0.29.1) or use resnet20"
)


def _channels(name: str, input_shape: tuple[int, ...]) -> int:
    if len(input_shape) != 3:
        raise ValueError(
            f"model {name!r} needs a (C, H, W) input shape, got {tuple(input_shape)}: "
            "use 'mlp' for flat inputs"
        )
    return int(input_shape[0])


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build model ``name`` for inputs of shape ``input_shape`` (no batch dim) and ``num_classes``.

    Names: ``mlp`` (:class:`MLP`, logits), ``cnn`` (:class:`SmallCNN`), ``resnet8``/``resnet20``
    (:func:`resnet_cifar`), ``resnet50`` (:class:`ResNet50`, torchvision's
    architecture), ``transformer`` (:class:`TinyTransformer`, image rows as tokens), ``gpt`` and ``gpt2``
    (nanoGPT's :class:`~paratrain.models.gpt.GPT`: 4 layers of 128, or GPT-2 124M's 12 of 768; for token
    windows, ``num_classes`` is the vocabulary), or
    ``torchvision:<name>`` (``torchvision.models.get_model(name, weights=None,
    num_classes=num_classes)``; untrained, nothing is downloaded), or the user's own factory
    ``module:function`` / ``file.py:function`` called as ``function(input_shape=..., num_classes=...)``.
    """
    input_shape = tuple(int(s) for s in input_shape)
    if not input_shape or any(s < 1 for s in input_shape):
        raise ValueError(f"input_shape {input_shape} must be non-empty with positive sizes")
    if num_classes < 1:
        raise ValueError(f"num_classes={num_classes} must be >= 1")
    if name == "mlp":
        return MLP(in_features=math.prod(input_shape), num_classes=num_classes)
    if name == "cnn":
        return SmallCNN(_channels(name, input_shape), num_classes)
    if name in ("gpt", "gpt2"):  # tokens in, every position's logits out: (T,) windows of a vocabulary
        if len(input_shape) != 1:
            raise ValueError(f"model {name!r} reads windows of tokens, shape (T,), got {input_shape}: train it on "
                             "--dataset tokens:PATH")
        if name == "gpt2":  # GPT-2 124M's shape
            return GPT(GPTConfig(block_size=input_shape[0], vocab_size=num_classes))
        return GPT(GPTConfig(block_size=input_shape[0], vocab_size=num_classes, n_layer=4, n_head=4, n_embd=128))
    if name == "transformer":
        # Images (C, H, W) are H tokens of C*W features (one per row); (T, F) is T tokens; (F,) one.
        if len(input_shape) == 3:
            tokens, features = input_shape[1], input_shape[0] * input_shape[2]
        elif len(input_shape) == 2:
            tokens, features = input_shape
        elif len(input_shape) == 1:
            tokens, features = 1, input_shape[0]
        else:
            raise ValueError(f"model 'transformer' needs a (C, H, W), (T, F) or (F,) input shape, got {input_shape}")
        return TinyTransformer(features, num_classes=num_classes, max_tokens=tokens)
    if name in ("resnet8", "resnet20"):
        depth = int(name[len("resnet"):])
        return resnet_cifar(depth, in_channels=_channels(name, input_shape), num_classes=num_classes)
    if name == "resnet50":
        return ResNet50(in_channels=_channels(name, input_shape), num_classes=num_classes)
    if is_user_spec(name):  # the user's own factory: fn(input_shape=..., num_classes=...) -> nn.Module
        factory = load_callable(name, "model")
        try:
            inspect.signature(factory).bind(input_shape=input_shape, num_classes=num_classes)
        except TypeError:
            raise ValueError(f"model {name!r}: paratrain calls it as {name.rpartition(':')[2]}(input_shape=..., "
                             "num_classes=...); write a function that takes those two keyword arguments and "
                             "builds your model with its own") from None
        model = factory(input_shape=input_shape, num_classes=num_classes)
        if not isinstance(model, nn.Module):
            raise ValueError(f"model {name!r} returned {type(model).__name__}, not an nn.Module")
        return model
    if name.startswith("torchvision:"):
        tv_name = name.split(":", 1)[1]
        try:
            import torchvision
        except ImportError:
            raise ValueError(_TORCHVISION_MISSING) from None
        try:
            return torchvision.models.get_model(tv_name, weights=None, num_classes=num_classes)
        except ValueError:
            raise ValueError(
                f"torchvision has no model {tv_name!r}: see torchvision.models.list_models()"
            ) from None
    raise ValueError(
        f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}, 'torchvision:<name>' "
        "or your own 'module:function'"
    )
