"""Models paratrain ships: an MLP, small CIFAR ResNets, a tiny CNN, a tiny transformer, and a name registry."""

from .mlp import MLP
from .registry import MODEL_NAMES, build_model
from .resnet import SmallCNN, resnet_cifar
from .transformer import TinyTransformer

__all__ = ["MLP", "MODEL_NAMES", "SmallCNN", "TinyTransformer", "build_model", "resnet_cifar"]
