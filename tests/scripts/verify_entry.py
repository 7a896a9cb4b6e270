"""Training functions for ``paratrain verify --entry``.

Hand-written DDP, plain PyTorch: ``grow_batch`` makes seed 000's mistake, the per-worker batch is
fixed, so the global batch grows with the world size (and the learning rate stays the same);
``global_batch`` splits a fixed global batch over the workers, which ``DistributedSampler`` then
makes identical to one process's.

``parallel_loop`` is the own-loop recipe with ``paratrain.Parallel``: it leaves the accumulation to
Parallel's defaults, where ``verify --check-accumulation`` sets it.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

GLOBAL_BATCH = 32


def _dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 20, generator=g)
    return TensorDataset(x, (x[:, :5].sum(1) > 0).long())


def _train(steps, batch_per_worker):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dataset = _dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_per_worker, sampler=sampler, drop_last=True)
    losses, step, epoch = [], 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if step == steps:
                break
        epoch += 1
    return model.module, losses


def grow_batch(steps):
    return _train(steps, GLOBAL_BATCH)  # 32 per worker: 64 samples per step on 2 workers


def global_batch(steps):
    return _train(steps, GLOBAL_BATCH // int(os.environ.get("WORLD_SIZE", "1")))


def parallel_loop(steps):
    import paratrain

    torch.manual_seed(0)
    pt = paratrain.Parallel(global_batch=GLOBAL_BATCH, seed=0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2))
    model, optimizer = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loader = pt.train_loader(_dataset())
    losses, micro = [], []
    while len(losses) < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            pt.backward(loss)
            optimizer.step()
            micro.append(loss.item())
            if pt.micro_step:  # mid-accumulation
                continue
            losses.append(sum(micro) / len(micro))  # the global batch's loss: equal micro-batches
            micro = []
            if len(losses) == steps:
                break
    return pt.unwrap(model), losses
