"""A hand-written DDP script for torchrun, as a user writes it: the same task as digits_single.py.

``torchrun --nproc-per-node 2 digits_ddp.py``: init_process_group, DistributedSampler, DDP, one
optimizer step, then the test accuracy on rank 0.
"""

import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
x, y = load_digits(return_X_y=True)
x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
y = torch.tensor(y)
perm = torch.randperm(len(y))
test, train = perm[:359], perm[359:]
mean, std = x[train].mean(), x[train].std()
x = (x - mean) / std
model = DDP(nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
trainset = TensorDataset(x[train], y[train])
sampler = DistributedSampler(trainset, shuffle=True, seed=0)
loader = DataLoader(trainset, batch_size=64 // world, sampler=sampler)
sampler.set_epoch(0)
for xb, yb in loader:
    opt.zero_grad()
    nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
    break
if rank == 0:
    with torch.no_grad():
        acc = (model.module(x[test]).argmax(1) == y[test]).float().mean().item()
    print(f"test accuracy {acc:.4f}")
dist.barrier()
dist.destroy_process_group()
os._exit(0)
