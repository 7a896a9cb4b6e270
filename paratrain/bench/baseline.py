"""The hand-written plain-PyTorch DDP loop that ``paratrain bench`` (and ``benchmarks/overhead.py``)
measures paratrain's ``ddp`` against: a typical hand-written DDP loop, with nothing of paratrain in it.

``init_process_group`` is the caller's (it may share a group with another loop); then::

    sampler = DistributedSampler(trainset, shuffle=True, seed=seed)
    loader = DataLoader(trainset, batch_size=per_worker_batch, sampler=sampler, drop_last=True)
    net = DDP(net)
    for epoch ...: sampler.set_epoch(epoch); for x, y in loader: zero_grad, loss, backward, step
"""

from __future__ import annotations

from typing import Any, Callable, Generator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

__all__ = ["plain_ddp_steps"]


def plain_ddp_steps(
    net: nn.Module,
    trainset: Dataset,
    batch_size: int,
    *,
    lr: float = 0.001,
    momentum: float = 0.9,
    seed: int = 0,
    device: torch.device | str = "cpu",
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
) -> Generator[Any, None, None]:
    """A typical hand-written DDP training loop as a generator over steps.

    The first ``next()`` sets up (sampler, loader, ``DDP(net)``, optimizer) and yields the DDP model;
    every later ``next()`` runs exactly one training step and yields its loss (not synchronised:
    no ``.item()`` inside the loop). It runs epoch after epoch until closed. ``net`` must already
    be on ``device``; the process group must be initialised.
    """
    device = torch.device(device)
    train_sampler: DistributedSampler[Any] = DistributedSampler(dataset=trainset, shuffle=True, seed=seed)
    trainloader = DataLoader(trainset, batch_size=batch_size, sampler=train_sampler, drop_last=True)
    net = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    criterion = nn.CrossEntropyLoss()
    optimizer = make_optimizer(net) if make_optimizer else torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    yield net  # set up

    epoch = 0
    while True:
        train_sampler.set_epoch(epoch)
        for images, labels in trainloader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            outputs = net(images)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            yield loss.detach()
        epoch += 1
