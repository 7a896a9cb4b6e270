"""Your HuggingFace loop under paratrain: a small GPT-2 language model or a BERT classifier, built
from a config (nothing is downloaded), dict batches, ``model(**batch)``, ``out.loss`` and a
transformers LR schedule, in bf16-mixed.

    python examples/hf_loop.py --model gpt2
    python -m paratrain run --nproc-per-node 2 examples/hf_loop.py --model gpt2 --strategy ddp
    python -m paratrain run --nproc-per-node 2 examples/hf_loop.py --model bert --strategy fsdp

The data is synthetic but learnable (token sequences that follow a fixed rule; the class is a
function of the first token), so the loss falls within a few dozen steps on a CPU. Needs
``pip install transformers``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils.data import Dataset

import paratrain

VOCAB, LENGTH = 64, 16
BLOCKS = {"gpt2": "GPT2Block", "bert": "BertLayer"}  # what fsdp shards as one unit


def build_model(kind: str) -> torch.nn.Module:
    """A tiny GPT-2 or BERT classifier from its config, dropout off."""
    import transformers

    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0,
            loss_type="ForCausalLM",
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=LENGTH, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class TokenData(Dataset):
    """Dict samples as a tokenizer would give them: ``input_ids``, ``attention_mask``, ``labels``.

    Each sequence counts up by a fixed stride from a random start (mod the vocabulary): a causal
    LM can learn the rule. For the classifier the label is whether the first token is in the
    lower half of the vocabulary.
    """

    def __init__(self, kind: str, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + 3 * torch.arange(LENGTH)) % VOCAB
        self.labels = self.ids.clone() if kind == "gpt2" else (self.ids[:, 0] < VOCAB // 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(LENGTH, dtype=torch.long), "labels": self.labels[i]}


def train(pt: paratrain.Parallel, kind: str, steps: int, lr: float = 3e-3, n: int = 256) -> tuple[Any, list[float]]:
    """Train ``kind`` for ``steps`` optimizer steps; returns the set-up model and the loss per step."""
    import transformers

    model = build_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=steps // 5 + 1,
                                                             num_training_steps=steps)
    # The scheduler steps once per optimizer step, whatever the accumulation.
    model, optimizer, scheduler = pt.setup(model, optimizer, scheduler)
    loader = pt.train_loader(TokenData(kind, n))  # dict batches, on the device
    losses: list[float] = []
    while pt.global_step < steps:
        for batch in loader:
            optimizer.zero_grad()
            out = model(**batch)  # a ModelOutput, in bf16-mixed too
            pt.backward(out.loss)
            optimizer.step()
            scheduler.step()
            if pt.micro_step == 0:  # an optimizer step happened: log the loss averaged over ranks
                losses.append(pt.reduce(out.loss.detach(), "mean").item())
            if pt.global_step >= steps:
                break
    return model, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=sorted(BLOCKS))
    parser.add_argument("--strategy", default="single", help="single, ddp or fsdp")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    pt = paratrain.Parallel(strategy=args.strategy, precision=args.precision, global_batch=16,
                            fsdp={"wrap_classes": [BLOCKS[args.model]]})
    model, losses = train(pt, args.model, args.steps)
    metrics = pt.evaluate(model, pt.eval_loader(TokenData(args.model, 64, seed=1)))  # the model's own loss
    pt.print(f"{args.model} {args.strategy} on {pt.world_size} process(es): loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
             f"eval {', '.join(f'{k} {v:.4g}' for k, v in metrics.items())}")
    pt.close()


if __name__ == "__main__":
    main()
