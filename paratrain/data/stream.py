"""Streaming data (``IterableDataset``): the same global batches at any world size, no hang at the end.

A stream has no length and cannot be indexed, so its global order is defined by reading it:

* A stream is one or more *shards*: a plain ``IterableDataset`` is one shard; a
  :class:`ShardedStream` has one per source (a file, a URL...), read by ``read(source)``.
* Global batch ``s`` (``B`` samples) takes the next chunk of every shard: shard ``k`` of ``K``
  gives samples ``[s*c_k, (s+1)*c_k)``, with chunk sizes ``c_k`` that add up to ``B`` (``B/K``
  each when ``K`` divides ``B``). Positions ``0..B-1`` of the global batch are the chunks in
  shard order.
* Rank ``r`` of ``W`` takes the contiguous positions ``[r*B/W, (r+1)*B/W)``, micro-step ``a``
  the ``a``-th ``m`` of them. So every optimizer step holds the same samples at world size 1, 2
  or 4. (Without accumulation a micro-step's samples are the same too; with it, unlike the
  map-style sampler, which samples share a micro-step — what BatchNorm sees — follows the ranks.)
* A rank reads only the shards its positions fall in (4 shards on 4 ranks: one file each; on 2
  ranks: two each), reading and dropping the rest of a chunk it shares with another rank.
* The stream ends at the first global batch that some shard cannot fill: before each step, the
  ranks agree (one all-reduce of one number) whether all of them have it, so every rank runs the
  same number of steps, whatever the shards' unknown lengths.
* DataLoader workers split the rank's micro-batches round-robin (worker ``w`` of ``n`` collates
  micro-batches ``w, w+n, ...``), so no sample is duplicated and the order is kept; each worker
  reads the rank's shards itself.

Each pass over the loader is a pass over the stream (``set_epoch(epoch)`` is called on the
dataset when it has one). A resumed run finds its place by reading: every rank counts the steps
its shards fill in each pass before the checkpoint's step (the smallest count over ranks is that
pass's length), then skips to the step within its pass. A stream cannot seek, so resuming costs
a read of what was already trained on.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils import worker as _worker_state

from .batch import to_device
from .sampler import BatchPlan

__all__ = ["ShardedStream", "RankStream", "StreamLoader"]


class ShardedStream(IterableDataset):
    """A stream made of shards (files...), each read by ``read(source)`` on the ranks that need it.

    Iterated by itself (outside paratrain) it yields the shards one after another.
    """

    def __init__(self, sources: Sequence[Any], read: Callable[[Any], Iterable[Any]]) -> None:
        if not sources:
            raise ValueError("ShardedStream needs at least one source")
        self.sources = list(sources)
        self.read = read

    def __iter__(self) -> Iterator[Any]:
        for source in self.sources:
            yield from self.read(source)


def _shards(dataset: IterableDataset) -> int:
    return len(dataset.sources) if isinstance(dataset, ShardedStream) else 1


def _read_shard(dataset: IterableDataset, k: int) -> Iterator[Any]:
    return iter(dataset.read(dataset.sources[k])) if isinstance(dataset, ShardedStream) else iter(dataset)


class RankStream(IterableDataset):
    """One rank's samples of a stream, in micro-batch order, from step ``skip`` of a pass on
    (the steps before are read and dropped). In a DataLoader worker, only that worker's share
    of the micro-batches."""

    def __init__(self, dataset: IterableDataset, plan: BatchPlan, rank: int, skip: int = 0, epoch: int = 0) -> None:
        k = _shards(dataset)
        if plan.global_batch < k:
            raise ValueError(f"a global batch of {plan.global_batch} cannot take a sample from each of {k} shards: "
                             f"use a global batch of at least {k}")
        self.dataset, self.plan, self.rank, self.skip, self._epoch = dataset, plan, rank, skip, epoch
        self.bounds = [plan.global_batch * i // k for i in range(k + 1)]  # chunk k = positions [bounds[k], bounds[k+1])
        share = plan.global_batch // plan.world_size  # this rank's contiguous positions: the fewest shards
        self.positions = [[rank * share + a * plan.micro_batch + j for j in range(plan.micro_batch)]
                          for a in range(plan.accumulation)]
        wanted = {p for micro in self.positions for p in micro}
        self.needed = [i for i in range(k) if any(self.bounds[i] <= p < self.bounds[i + 1] for p in wanted)]

    def _shard_of(self, p: int) -> int:
        return next(i for i in self.needed if self.bounds[i] <= p < self.bounds[i + 1])

    def _start(self) -> dict[int, Iterator[Any]]:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self._epoch)
        return {k: _read_shard(self.dataset, k) for k in self.needed}

    def _next_step(self, readers: dict[int, Iterator[Any]]) -> dict[int, list[Any]] | None:
        """The next chunk of every shard this rank reads, or None when one cannot fill it."""
        chunks = {}
        for k, reader in readers.items():
            size = self.bounds[k + 1] - self.bounds[k]
            chunks[k] = list(islice(reader, size))
            if len(chunks[k]) < size:
                return None
        return chunks

    def count_steps(self, limit: int) -> int:
        """How many steps of this pass this rank's shards can fill, up to ``limit`` (reads them)."""
        readers = self._start()
        n = 0
        while n < limit and self._next_step(readers) is not None:
            n += 1
        return n

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            # paratrain splits the micro-batches between workers: the dataset must read as if alone.
            # One that splits by worker itself (HuggingFace's IterableDataset does) would otherwise
            # hand this worker a part of the stream, and samples would be lost. This process is the
            # DataLoader's worker for this pass only (streams get no persistent workers).
            _worker_state._worker_info = None
        readers = self._start()
        step, micro = 0, 0
        while True:
            chunks = self._next_step(readers)
            if chunks is None:
                return  # a shard cannot fill the step: the stream ends here
            if step >= self.skip:
                for positions in self.positions:
                    if micro % workers == worker:
                        for p in positions:
                            k = self._shard_of(p)
                            yield chunks[k][p - self.bounds[k]]
                    micro += 1
            step += 1


class StreamLoader:
    """A rank's micro-batches of a stream, on the device, with every rank running the same steps.

    ``min_all(n)`` is a collective returning the smallest ``n`` over all ranks; ``position``
    returns the global optimizer step (the trainer's, as for map-style loaders).
    """

    def __init__(self, dataset: IterableDataset, plan: BatchPlan, rank: int, device: torch.device,
                 min_all: Callable[[int], int], position: Callable[[], int], **dataloader_kwargs: Any) -> None:
        RankStream(dataset, plan, rank)  # checks the plan against the shards now, not at the first batch
        self.dataset, self.plan, self.rank, self.device = dataset, plan, rank, device
        self.min_all, self.position = min_all, position
        self.pin_memory = bool(dataloader_kwargs.get("pin_memory"))
        dataloader_kwargs.pop("persistent_workers", None)  # each pass is a new stream object: new workers
        self.dataloader_kwargs = dataloader_kwargs
        self._epoch = 0  # passes completed over the stream
        self.pass_start = 0  # the global step at which the current pass began
        self._located = False

    @property
    def epoch(self) -> int:
        """The pass over the stream the next batch belongs to: after a resume, ``for epoch in
        range(loader.epoch, epochs)`` continues the epoch loop. After a resume, the first read
        (or iteration) finds the pass by counting the stream's steps up to the global step, a
        collective: read it on every rank."""
        self._locate_once()
        return self._epoch

    def _locate_once(self) -> None:
        if not self._located:
            self._locate(self.position())
            self._located = True

    @property
    def steps_per_epoch(self) -> int:
        raise TypeError("a stream has no known number of steps per epoch: train for a number of steps")

    def __len__(self) -> int:
        raise TypeError("a stream has no length: train for a number of steps (while pt.global_step < steps)")

    def _locate(self, position: int) -> None:
        """Find the pass and its first step for a run that starts at ``position`` (a resumed one):
        count each pass's steps (every rank its shards, then the minimum over ranks) until the
        pass that holds ``position``. Reads the stream up to there."""
        skip = position
        while skip > 0:
            n = self.min_all(RankStream(self.dataset, self.plan, self.rank, 0, self._epoch).count_steps(skip + 1))
            if n > skip:
                break  # position lies inside this pass
            if n == 0:
                raise ValueError(f"the stream holds no complete global batch of {self.plan.global_batch} samples "
                                 f"in pass {self._epoch}: cannot resume at step {position}")
            skip, self.pass_start, self._epoch = skip - n, self.pass_start + n, self._epoch + 1

    def __iter__(self) -> Iterator[Any]:
        self._locate_once()
        p = self.plan
        while True:
            start = self.position()
            skip = start - self.pass_start
            stream = RankStream(self.dataset, p, self.rank, skip, self._epoch)
            # A generator of the pass's own: each DataLoader iterator draws a seed from one, from the
            # global RNG (dropout's) without it, and a resumed run would then draw once more.
            kwargs = {"generator": torch.Generator().manual_seed(self._epoch), **self.dataloader_kwargs}
            batches = iter(DataLoader(stream, batch_size=p.micro_batch, drop_last=True, **kwargs))
            steps = 0
            while True:
                step = list(islice(batches, p.accumulation))  # the whole step first: then agree, then train
                if self.min_all(int(len(step) == p.accumulation)) == 0:
                    break
                for batch in step:
                    yield to_device(batch, self.device, non_blocking=self.pin_memory)
                steps += 1
            if steps == 0 and skip == 0:  # the same on every rank: the agreement is global
                raise ValueError(f"the stream holds no complete global batch of {p.global_batch} samples "
                                 f"(pass {self._epoch})")
            self._epoch += 1
            self.pass_start = self.position()
            if steps:
                return  # one pass per iteration of the loader; a loop stopped exactly at its end starts the next
