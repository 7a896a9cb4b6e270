"""Models shaped like the ones users bring, for the strategy tests: built from tiny configs, no
download, dropout off.

* :class:`GPT`: nanoGPT's model as Karpathy writes it: ``transformer = ModuleDict(wte, wpe, drop,
  h=ModuleList(Block), ln_f)``, a fused ``c_attn`` Linear split into q, k, v in the forward, and
  ``lm_head`` tied to ``wte``;
* :class:`BlockNet`: a plain model whose root holds its blocks in a ``ModuleList``;
* :func:`hf_model`: a tiny HuggingFace GPT-2 (tied), BERT classifier or Llama (untied).

Every model takes a ``(batch, tokens)`` LongTensor and returns logits; :func:`logits` unwraps a
HuggingFace output. :class:`Tokens` is a data set of ``(ids, target)`` pairs for them.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from paratrain.models.gpt import GPT as _GPT
from paratrain.models.gpt import MLP, Block, GPTConfig  # noqa: F401  (Block: the tests name it)

VOCAB, LENGTH, WIDTH = 32, 8, 16


class GPT(_GPT):
    """nanoGPT's GPT (paratrain's built-in copy of its model.py), tiny: 2 heads."""

    def __init__(self, n_layer: int = 2, n_embd: int = WIDTH, vocab: int = VOCAB, block_size: int = LENGTH) -> None:
        super().__init__(GPTConfig(block_size=block_size, vocab_size=vocab, n_layer=n_layer, n_head=2, n_embd=n_embd))


class BlockNet(nn.Module):
    """Embedding, a ``ModuleList`` of residual MLP blocks, a head: the root holds a container."""

    def __init__(self, n_layer: int = 3, n_embd: int = WIDTH, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, n_embd)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(n_embd), MLP(n_embd)) for _ in range(n_layer)])
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def hf_model(kind: str) -> nn.Module:
    """A tiny HuggingFace model from its config: gpt2 (tied), bert (a classifier) or llama."""
    import transformers

    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
    if kind == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=LENGTH, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=LENGTH, tie_word_embeddings=False))
    raise ValueError(kind)


def logits(output: object) -> torch.Tensor:
    """A model's logits, whether it returns a tensor or a HuggingFace output object."""
    return output if isinstance(output, torch.Tensor) else output.logits  # type: ignore[attr-defined]


def loss_of(output: object, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of next-token logits (B, T, V) or class logits (B, C) against ``target``."""
    out = logits(output)
    if out.dim() == 3:
        return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))
    return F.cross_entropy(out, target)


class Tokens(Dataset):
    """``(ids, target)`` pairs: sequences counting up by 3 from a random start; the target is the
    next token of each position (``classes=None``) or whether the first token is below half the
    vocabulary (``classes=2``)."""

    def __init__(self, n: int, classes: int | None = None, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + 3 * torch.arange(LENGTH)) % VOCAB
        self.target = (self.ids + 3) % VOCAB if classes is None else (self.ids[:, 0] < VOCAB // 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i], self.target[i]


# --- the two halves of a parity run on these models ------------------------------------------------
def train_parallel(make: Callable[[], nn.Module], strategy: str, *, steps: int, global_batch: int, seed: int,
                   data: Dataset, lr: float = 0.5, init_module: bool = False, **options: object) -> dict[str, torch.Tensor]:
    """``steps`` SGD steps (momentum 0.9) of ``make().double()`` through ``Parallel(strategy, **options)``
    (built under ``pt.init_module()`` with ``init_module``); the full state dict. Call it on every rank of a launch."""
    import contextlib

    import paratrain

    pt = paratrain.Parallel(strategy=strategy, global_batch=global_batch, seed=seed, **options)
    with pt.init_module() if init_module else contextlib.nullcontext():
        model = make().double()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, opt = pt.setup(model, opt)
    for step, (ids, target) in enumerate(pt.train_loader(data)):
        if step == steps:
            break
        opt.zero_grad()
        pt.backward(loss_of(model(ids), target))
        opt.step()
    return pt.full_state_dict(model)


def train_plain(make: Callable[[], nn.Module], *, steps: int, global_batch: int, seed: int, data: Tokens,
                lr: float = 0.5, clip_grad_norm: float | None = None) -> dict[str, torch.Tensor]:
    """The same in plain PyTorch, one process, over paratrain's documented sample order (clipping
    the gradient's norm to ``clip_grad_norm`` when given)."""
    from parity import global_batches

    torch.manual_seed(seed)
    model = make().double()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for idx in global_batches(len(data), global_batch, seed, steps):
        opt.zero_grad()
        loss_of(model(data.ids[idx]), data.target[idx]).backward()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
