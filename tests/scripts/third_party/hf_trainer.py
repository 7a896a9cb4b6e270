"""A HuggingFace ``Trainer`` script as users write it, unchanged: ``paratrain run`` launches it as
torchrun would (tests/cli/test_third_party_scripts.py)."""

import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class Tokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 100, (16,), generator=g), "labels": torch.tensor(i % 2)}


torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                 num_attention_heads=2, intermediate_size=64))
args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=8, max_steps=4, report_to=[],
                         use_cpu=True, save_strategy="no", ddp_backend="gloo", disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Tokens()).train()
checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
print(f"RANK {dist.get_rank()} WORLD {dist.get_world_size()} CHECKSUM {checksum:.12e}", flush=True)
