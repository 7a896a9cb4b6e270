"""DataLoaders built on the global-batch samplers; batches arrive on the training device."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from .batch import to_device
from .sampler import BatchPlan, GlobalBatchSampler, ShardedEvalSampler

__all__ = ["to_device", "GlobalBatchLoader", "EvalLoader", "step_seed"]


def step_seed(seed: int, global_step: int, micro_step: int) -> int:
    """A seed for the random augmentation of one micro-step, the same on every rank."""
    digest = hashlib.blake2b(f"{seed}:{global_step}:{micro_step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class GlobalBatchLoader:
    """Iterates this rank's micro-batches from the current global step, on the device.

    ``position`` (a callable returning the global optimizer step) makes the trainer, not the
    prefetching DataLoader, the source of truth for where an epoch resumes. ``transform`` is a
    batched augmentation called as ``transform(x, seed, offset, total)`` so that a global batch
    split across ranks is augmented exactly as if it were processed whole.
    """

    def __init__(
        self,
        dataset: Dataset,
        plan: BatchPlan,
        rank: int,
        device: torch.device,
        seed: int = 0,
        position: Callable[[], int] | None = None,
        transform: Callable[..., torch.Tensor] | None = None,
        shuffle: bool = True,
        **dataloader_kwargs: Any,
    ) -> None:
        self.sampler = GlobalBatchSampler(len(dataset), plan, rank, seed, shuffle)  # type: ignore[arg-type]
        self.plan, self.rank, self.device, self.seed = plan, rank, device, seed
        self.position = position or (lambda: self.sampler.position)
        self.transform = transform
        self.pin_memory = bool(dataloader_kwargs.get("pin_memory"))
        # A private generator: each new DataLoader iterator draws a worker base seed from it, which
        # would otherwise advance the global RNG (dropout) differently in a resumed run.
        dataloader_kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        self.dataloader = DataLoader(dataset, batch_sampler=self.sampler, **dataloader_kwargs)

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def __len__(self) -> int:
        self.sampler.set_position(self.position())
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        start = self.position()
        self.sampler.set_position(start)
        p = self.plan
        for i, batch in enumerate(self.dataloader):
            batch = to_device(batch, self.device, non_blocking=self.pin_memory)
            if self.transform is not None:
                step, micro = start + i // p.accumulation, i % p.accumulation
                x = self.transform(
                    batch[0], step_seed(self.seed, step, micro), self.rank * p.micro_batch, p.micro_batch * p.world_size
                )
                batch = (x, *batch[1:])
            yield batch


class StridedStream(IterableDataset):
    """Every ``world_size``-th sample of ``dataset`` from ``rank`` on: one rank's share of an
    evaluation stream (each sample once across ranks); DataLoader workers split it again."""

    def __init__(self, dataset: IterableDataset, world_size: int, rank: int) -> None:
        self.dataset, self.world_size, self.rank = dataset, world_size, rank

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i, sample in enumerate(self.dataset):
            if i % self.world_size == self.rank and (i // self.world_size) % workers == worker:
                yield sample


class EvalLoader:
    """Evaluation batches of this rank's shard (each sample once across ranks), on the device.
    A stream (``IterableDataset``) is shared out sample by sample; its length is unknown."""

    def __init__(self, dataset: Dataset, batch_size: int, world_size: int, rank: int, device: torch.device,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None, **dataloader_kwargs: Any) -> None:
        self.device = device
        self.transform = transform
        self.stream = isinstance(dataset, IterableDataset)
        if self.stream:
            self.dataloader = DataLoader(StridedStream(dataset, world_size, rank), batch_size=batch_size,  # type: ignore[arg-type]
                                         **dataloader_kwargs)
        else:
            self.sampler = ShardedEvalSampler(len(dataset), world_size, rank)  # type: ignore[arg-type]
            self.dataloader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, **dataloader_kwargs)

    def __len__(self) -> int:
        if self.stream:
            raise TypeError("an evaluation stream has no length: iterate it")
        return len(self.dataloader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.dataloader:
            batch = to_device(batch, self.device)
            if self.transform is not None:
                batch = (self.transform(batch[0]), *batch[1:])
            yield batch
