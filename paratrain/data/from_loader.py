"""What a user's own DataLoader reads in an epoch, as a dataset paratrain's samplers can shard.

``Parallel.train_loader(loader)`` and ``Parallel.eval_loader(loader)`` replace the loader's sampler
with paratrain's; the samples it selects must stay the same. A ``SubsetRandomSampler`` (a train/val
split of one dataset) or any sampler that reads part of the dataset, each sample once, becomes a
``Subset``; a ``DistributedSampler`` (what a DDP script has) is the whole dataset, sharded by
paratrain instead; a sampler that draws samples more than once (``WeightedRandomSampler``,
``replacement=True``) is refused in one line: paratrain reads each sample once an epoch.

torchdata's ``StatefulDataLoader`` is a DataLoader too, and its own ``RandomSampler`` (not torch's class) is read as
torch's. Its ``state_dict()`` is not needed: paratrain's checkpoint holds the global step, the data position its
sampler starts from, which resumes at any world size (a loader's own state is one rank's, at one world size).
"""

from __future__ import annotations

import random
from typing import Any, TypeGuard

import numpy as np
import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler,
                              SequentialSampler, Subset, SubsetRandomSampler)

__all__ = ["loader_samples"]


def loader_samples(loader: DataLoader, where: str) -> tuple[Dataset, bool | None]:
    """``(dataset, random)``: the samples ``loader`` reads in an epoch, and whether its order was
    random (None: not known). ``where`` names the caller in an error (``train_loader``)."""
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        return dataset, None
    sampler = loader.sampler if loader.batch_size is not None else loader.batch_sampler
    while isinstance(sampler, BatchSampler):  # its batching (and drop_last) is replaced: what it batches counts
        sampler = sampler.sampler
    n = len(dataset)  # type: ignore[arg-type]
    if isinstance(sampler, SequentialSampler):
        return dataset, False
    if isinstance(sampler, DistributedSampler):  # replacing it is the point
        return dataset, bool(sampler.shuffle)
    if _random_sampler(sampler) and not sampler.replacement:
        if sampler.num_samples != n:
            raise ValueError(f"{where}: the DataLoader's RandomSampler draws {sampler.num_samples} of the {n} samples, "
                             "a different part every epoch; paratrain reads each sample once an epoch: pass the "
                             "dataset (and bound the run with max steps), or a Subset of it")
        return dataset, True
    if isinstance(sampler, SubsetRandomSampler):
        indices = [int(i) for i in sampler.indices]
        random_order = True
    else:
        indices = _one_epoch(sampler)
        random_order = None
    name = type(sampler).__name__
    if len(set(indices)) != len(indices):
        raise ValueError(f"{where}: the DataLoader's {name} draws some samples more than once an epoch (weighted, or "
                         "with replacement); paratrain reads each sample once an epoch, the same at any world size: "
                         "pass the dataset, or a Subset of it")
    if len(indices) == n:
        return dataset, random_order
    return Subset(dataset, indices), random_order


def _random_sampler(sampler: Any) -> TypeGuard[RandomSampler]:
    """torch's ``RandomSampler``, or torchdata's stateful one (``StatefulDataLoader(shuffle=True)``'s: the same
    arguments and draw, with a state; not a subclass, and torchdata is not imported for it)."""
    cls = type(sampler)
    return isinstance(sampler, RandomSampler) or (cls.__name__ == "RandomSampler"
                                                  and cls.__module__.startswith("torchdata.stateful_dataloader"))


def _one_epoch(sampler: Any) -> list[int]:
    """The indices ``sampler`` gives in one epoch (flattened when it gives batches), without moving
    torch's, Python's or NumPy's global random state."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            drawn = list(iter(sampler))
        finally:
            random.setstate(py)
            np.random.set_state(npy)
    out: list[int] = []
    for item in drawn:
        if isinstance(item, (list, tuple)) or (isinstance(item, torch.Tensor) and item.ndim > 0):
            out.extend(int(i) for i in item)
        else:
            out.append(int(item))
    return out
