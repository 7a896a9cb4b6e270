"""nanoGPT's GPT (Karpathy's ``model.py``), the built-in language model.

The same modules and names as nanoGPT: ``transformer = ModuleDict(wte, wpe, drop, h=ModuleList(Block),
ln_f)``, each block a fused ``c_attn`` Linear split into q, k, v, ``c_proj``, an MLP of ``c_fc`` and
``c_proj``, and ``lm_head`` tied to ``wte``; its initialisation (normal 0.02, ``c_proj`` scaled by
``1/sqrt(2 n_layer)``). So its checkpoints load into nanoGPT's model and back, and every strategy
meets it as it meets the user's own copy. One difference: ``forward(idx)`` returns every position's
logits ``(batch, tokens, vocab)`` (nanoGPT returns the last position's only when no targets are
given); the loss is the caller's (:func:`token_loss`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..precision.base import fp32_loss

__all__ = ["GPT", "GPTConfig", "Block", "token_loss", "flops_per_token"]


@dataclass(frozen=True)
class GPTConfig:
    """nanoGPT's ``GPTConfig``; the defaults are GPT-2 124M's (vocabulary padded to 50,304)."""

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        if min(self.block_size, self.vocab_size, self.n_layer, self.n_head, self.n_embd) < 1:
            raise ValueError(f"GPTConfig sizes must be at least 1: {self}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}: pick a width that is")


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int = 2, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT for ``config`` (a :class:`GPTConfig`, or its fields as keywords)."""

    def __init__(self, config: GPTConfig | None = None, **fields: object) -> None:
        super().__init__()
        c = self.config = config or GPTConfig(**fields)  # type: ignore[arg-type]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd),
            wpe=nn.Embedding(c.block_size, c.n_embd),
            drop=nn.Dropout(c.dropout),
            h=nn.ModuleList([Block(c.n_embd, c.n_head, c.dropout, c.bias) for _ in range(c.n_layer)]),
            ln_f=nn.LayerNorm(c.n_embd, bias=c.bias),
        ))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer["wte"].weight = self.lm_head.weight  # weight tying, as nanoGPT does
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"GPT got {idx.size(1)} tokens, more than its block_size {self.config.block_size}")
        t = self.transformer
        pos = torch.arange(idx.size(1), device=idx.device)
        x = t["drop"](t["wte"](idx) + t["wpe"](pos))
        for block in t["h"]:  # type: ignore[attr-defined]  # a ModuleList
            x = block(x)
        return self.lm_head(t["ln_f"](x))


@fp32_loss
def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``(batch, tokens, vocab)`` logits against ``(batch, tokens)`` ids
    (nanoGPT's: targets of -1 are ignored)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def flops_per_token(model: GPT) -> float:
    """Training FLOPs per token, nanoGPT's estimate (PaLM's appendix B): ``6 N + 12 L H Q T``, with
    ``N`` the parameters without the position embedding, ``L`` layers, ``H`` heads, ``Q`` the head
    width and ``T`` the block size."""
    c = model.config
    n = sum(p.numel() for p in model.parameters()) - c.block_size * c.n_embd  # wpe's weight
    return 6 * n + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * c.block_size
