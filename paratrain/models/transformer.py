"""A tiny transformer: a plain ``nn.Sequential`` of blocks, for the pipeline and tensor examples.

``tokens -> block x n_blocks -> head``. Being an ``nn.Sequential`` (forward = children in
order), it can be cut between any two children by ``pipeline`` and ``devices``, and every
tensor passed between children is one ``(batch, tokens, dim)`` activation.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

__all__ = ["TinyTransformer", "Tokens", "Block", "Head"]


class Tokens(nn.Module):
    """Inputs to ``(batch, tokens, dim)``: images ``(B, C, H, W)`` become ``H`` tokens (one per row,
    ``C*W`` features), sequences ``(B, T, F)`` stay, vectors ``(B, F)`` are one token; then a
    Linear embedding plus a learned position embedding."""

    def __init__(self, in_features: int, dim: int, max_tokens: int) -> None:
        super().__init__()
        self.max_tokens = max_tokens
        self.embed = nn.Linear(in_features, dim)
        self.position = nn.Embedding(max_tokens, dim)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 4:
            x = x.permute(0, 2, 1, 3).flatten(2)  # (B, C, H, W) -> (B, H, C*W)
        elif x.dim() == 2:
            x = x.unsqueeze(1)
        if x.shape[1] > self.max_tokens:
            raise ValueError(f"TinyTransformer got {x.shape[1]} tokens, more than max_tokens={self.max_tokens}")
        positions = torch.arange(x.shape[1], device=x.device)
        return self.embed(x) + self.position(positions)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, dim: int, n_heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """LayerNorm, mean over tokens, Linear to class logits."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.ln(x).mean(dim=1))


class TinyTransformer(nn.Sequential):
    """``TinyTransformer(in_features, dim, n_blocks, n_heads, num_classes)``: children ``tokens``,
    ``block0`` .. ``block{n-1}``, ``head`` (split points for ``pipeline``/``devices``)."""

    def __init__(self, in_features: int, dim: int = 32, n_blocks: int = 2, n_heads: int = 2,
                 num_classes: int = 10, max_tokens: int = 64) -> None:
        if min(in_features, dim, n_blocks, n_heads, num_classes, max_tokens) < 1:
            raise ValueError(
                f"TinyTransformer sizes must be >= 1: in_features={in_features}, dim={dim}, n_blocks={n_blocks}, "
                f"n_heads={n_heads}, num_classes={num_classes}, max_tokens={max_tokens}"
            )
        if dim % n_heads:
            raise ValueError(f"TinyTransformer dim={dim} must be divisible by n_heads={n_heads}")
        layers: OrderedDict[str, nn.Module] = OrderedDict(tokens=Tokens(in_features, dim, max_tokens))
        for i in range(n_blocks):
            layers[f"block{i}"] = Block(dim, n_heads)
        layers["head"] = Head(dim, num_classes)
        super().__init__(layers)
