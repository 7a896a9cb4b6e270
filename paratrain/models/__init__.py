"""Models paratrain ships: seed 003's MLP, small CIFAR ResNets, a tiny CNN, and a name registry."""

from .mlp import MLP
from .registry import MODEL_NAMES, build_model
from .resnet import SmallCNN, resnet_cifar

__all__ = ["MLP", "MODEL_NAMES", "SmallCNN", "build_model", "resnet_cifar"]
