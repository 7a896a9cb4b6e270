"""Models paratrain ships: an MLP, small CIFAR ResNets, a tiny CNN, a tiny transformer, nanoGPT's GPT, and a
name registry."""

from .gpt import GPT, GPTConfig, token_loss
from .mlp import MLP
from .registry import MODEL_NAMES, build_model
from .resnet import SmallCNN, resnet_cifar
from .transformer import TinyTransformer

__all__ = ["MLP", "MODEL_NAMES", "SmallCNN", "TinyTransformer", "GPT", "GPTConfig", "token_loss", "build_model",
           "resnet_cifar"]
