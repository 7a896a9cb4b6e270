"""DataLoaders built on the global-batch samplers; batches arrive on the training device.

A micro-batch of a dataset that can index many samples at once is read with one indexing
operation per tensor instead of one ``__getitem__`` per sample plus ``default_collate``
(:func:`batch_view`): a ``TensorDataset`` (every built-in dataset is one) or a ``Subset`` of one.
The batches are the same (values, dtypes, a list of tensors as ``default_collate`` gives for a
tuple sample). A dataset with ``__getitems__`` (torch's protocol) is already read with one call per
micro-batch by the DataLoader, followed by its collate.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Subset, TensorDataset, get_worker_info
from torch.utils.data._utils import worker as _worker_state
from torch.utils.data._utils.collate import default_collate, default_convert

from ..env.seeding import mix_seed
from .batch import to_device
from .sampler import BatchPlan, GlobalBatchSampler, ShardedEvalSampler

__all__ = ["to_device", "GlobalBatchLoader", "EvalLoader", "step_seed", "sample_seed", "batch_view", "TensorBatchView",
           "SeededSamples"]


def step_seed(seed: int, global_step: int, micro_step: int) -> int:
    """A seed for the random augmentation of one micro-step, the same on every rank."""
    return mix_seed(seed, global_step, micro_step, bits=63)


class TensorBatchView(Dataset):
    """Rows of ``tensors`` read a batch at a time: ``view[indices]`` is ``[t[rows] for t in tensors]``
    where ``rows`` are ``indices`` mapped through ``index`` (a ``Subset``'s indices) when given.

    Used with ``DataLoader(view, sampler=<a sampler of index lists>, batch_size=None)``: workers,
    pinning and prefetching still apply, to whole batches.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], index: torch.Tensor | None = None) -> None:
        self.tensors, self.index = tensors, index

    def __len__(self) -> int:
        return len(self.index) if self.index is not None else len(self.tensors[0])

    def __getitem__(self, indices: Any) -> list[torch.Tensor]:
        rows = torch.as_tensor(indices, dtype=torch.int64)
        if self.index is not None:
            rows = self.index[rows]
        return [_select_rows(t, rows) for t in self.tensors]


def _select_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = None
    if get_worker_info() is not None:
        # In a worker, write straight into shared memory as default_collate does: the batch then
        # crosses to the main process without another copy.
        storage = t._typed_storage()._new_shared(len(rows) * t[0].numel(), device=t.device)
        out = t.new(storage).resize_(len(rows), *t.shape[1:])
    # index_select copies whole rows: about 3x faster than advanced indexing (t[rows]) on images
    return torch.index_select(t, 0, rows, out=out)


def _overrides(obj: object, base: type, *names: str) -> bool:
    return any(getattr(type(obj), n, None) is not getattr(base, n, None) for n in names)


def batch_view(dataset: Dataset, collate_fn: Callable[..., Any] | None = None) -> TensorBatchView | None:
    """A view of ``dataset`` that reads a whole micro-batch with one indexing operation, or None.

    Only where the batch is provably what per-sample reads + ``default_collate`` give: a
    ``TensorDataset`` or a (nested) ``Subset`` of one, neither overriding how items are read, and
    no collate function of the user's.
    """
    if collate_fn not in (None, default_collate):
        return None
    index: torch.Tensor | None = None
    while isinstance(dataset, Subset) and not _overrides(dataset, Subset, "__getitem__", "__getitems__"):
        rows = torch.as_tensor(dataset.indices, dtype=torch.int64)
        index = rows if index is None else rows[index]
        dataset = dataset.dataset
    if not isinstance(dataset, TensorDataset) or _overrides(dataset, TensorDataset, "__getitem__", "__getitems__"):
        return None
    if any(t.layout != torch.strided or t.is_nested for t in dataset.tensors):
        return None  # default_collate refuses these: so does the per-sample path
    return TensorBatchView(tuple(dataset.tensors), index)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s random draws in ``epoch``: the same on every rank, at every
    world size, in a DataLoader worker or not, and in a resumed run."""
    return mix_seed(seed, epoch, index, bits=63)  # torch's manual_seed takes a non-negative int64


def sample_seeds(seed: int, epoch: int, indices: list[int]) -> list[int]:
    """:func:`sample_seed` of every index at once: the last step of the mix (``+ index``) on a NumPy
    array, whose uint64 sums wrap at ``2**64`` as the mix's modulo does."""
    base = np.uint64(mix_seed(seed, epoch, 0))
    return ((base + np.asarray(indices, dtype=np.int64).astype(np.uint64)) & np.uint64(2**63 - 1)).tolist()


class SeededSamples(Dataset):
    """``dataset`` whose samples draw their randomness (torchvision-style random transforms, on
    torch's, Python's or NumPy's global generator) from :func:`sample_seed`: before sample ``i`` of
    epoch ``e`` is read, the generators it draws from are seeded by ``(seed, e, i)``.

    So augmented sample ``i`` of epoch ``e`` is the same whichever rank reads it, at any world size
    and number of DataLoader workers, and after a resume mid-epoch. In the training process (no
    workers) the generators' state is put back after each micro-batch: dropout's stream does not
    see the reads. Index lists without an epoch (not from :class:`GlobalBatchSampler`) read as is.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        # Whether the reads draw from Python's and NumPy's generators. Seeding them costs 5 µs a
        # sample (more than reading a tensor row), so they are seeded only once a micro-batch is
        # seen to draw from them; that micro-batch is then read again, seeded. The outcome is the
        # same as seeding all three always: a generator that is not drawn from changes nothing.
        self.draws_python = self.draws_numpy = False

    _OWN = frozenset({"dataset", "seed", "draws_python", "draws_numpy"})

    def __getattr__(self, name: str) -> Any:
        # The user's dataset's attributes (a worker_init_fn reaches get_worker_info().dataset: this)
        if name in SeededSamples._OWN or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # ...and what it sets there (an h5py/lmdb handle opened per worker) is the user's dataset's.
        object.__setattr__(self, name, value) if name in SeededSamples._OWN else setattr(self.dataset, name, value)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        epoch = getattr(indices, "epoch", None)
        if epoch is None:
            return [self.dataset[i] for i in indices]
        saved = _global_rng_state() if get_worker_info() is None else None
        seeds = sample_seeds(self.seed, epoch, indices)
        try:
            while True:
                python = None if self.draws_python else random.getstate()
                numpy = None if self.draws_numpy else np.random.get_state()
                out = self._read(indices, seeds)
                drew_python = python is not None and random.getstate() != python
                drew_numpy = numpy is not None and not _same_numpy_state(numpy, np.random.get_state())
                if not (drew_python or drew_numpy):
                    return out  # no generator was drawn from unseeded
                self.draws_python |= drew_python  # read the micro-batch again, those seeded too
                self.draws_numpy |= drew_numpy
        finally:
            if saved is not None:
                torch.set_rng_state(saved[0])
                random.setstate(saved[1])
                np.random.set_state(saved[2])

    def _read(self, indices: list[int], seeds: list[int]) -> list[Any]:
        out = []
        for i, s in zip(indices, seeds):
            torch.default_generator.manual_seed(s)  # 1 µs
            if self.draws_python:
                random.seed(s)
            if self.draws_numpy:
                np.random.seed(s & 0xFFFFFFFF)
            out.append(self.dataset[i])
        return out


def _same_numpy_state(a: Any, b: Any) -> bool:
    return a[2] == b[2] and a[3] == b[3] and a[4] == b[4] and bool(np.array_equal(a[1], b[1]))


def _global_rng_state() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _reads_samples(dataset: Dataset) -> bool:
    """Whether a DataLoader reads ``dataset`` one ``__getitem__`` per sample: no ``__getitems__``
    of its own (torch's ``Subset`` forwards to its dataset's)."""
    while isinstance(dataset, Subset) and not _overrides(dataset, Subset, "__getitem__", "__getitems__"):
        dataset = dataset.dataset
    return getattr(type(dataset), "__getitems__", None) is None


def _batch_loader(dataset: Dataset, batches: Any, kwargs: dict[str, Any], seed: int | None = None) -> DataLoader:
    """A DataLoader over ``batches`` (a sampler of index lists): one read per batch where
    :func:`batch_view` allows it, else per-sample reads and the collate function, each sample's
    random draws seeded (:class:`SeededSamples`) when ``seed`` is given."""
    if getattr(dataset, "reads_batches", False) and kwargs.get("collate_fn") in (None, default_collate):
        # it reads a whole micro-batch from its index list (a TokenWindows): one call per batch
        return DataLoader(dataset, sampler=batches, batch_size=None, **{**kwargs, "collate_fn": default_convert})
    view = batch_view(dataset, kwargs.get("collate_fn"))
    if view is None:
        if seed is not None and _reads_samples(dataset):
            dataset = SeededSamples(dataset, seed)
        return DataLoader(dataset, batch_sampler=batches, **kwargs)
    kwargs = {**kwargs, "collate_fn": default_convert}  # what a DataLoader without batching uses
    return DataLoader(view, sampler=batches, batch_size=None, **kwargs)


def _read(dataloader: DataLoader) -> Iterator[Any]:
    """``iter(dataloader)``; but a :class:`TensorBatchView` read in this process (no workers, no
    pinning) is indexed directly, as the DataLoader would index it, without its per-batch
    machinery, and with the rows as a tensor (no list of ints to convert): 15-25 µs less a batch."""
    view = dataloader.dataset
    if dataloader.num_workers or dataloader.pin_memory:
        return iter(dataloader)
    if getattr(view, "reads_batches", False) and dataloader.batch_size is None:
        sampler = dataloader.sampler
        if isinstance(sampler, GlobalBatchSampler):  # the rows as an array, straight to its reader
            return (view.read_batch(rows, epoch) for epoch, rows in sampler.iter_arrays())  # type: ignore[attr-defined]
        return (view[indices] for indices in sampler)  # type: ignore[index]
    if not isinstance(view, TensorBatchView):
        return iter(dataloader)
    sampler = dataloader.sampler
    batches = sampler.iter_rows() if isinstance(sampler, GlobalBatchSampler) else iter(sampler)
    return (view[rows] for rows in batches)


class GlobalBatchLoader:
    """Iterates this rank's micro-batches from the current global step, on the device.

    ``position`` (a callable returning the global optimizer step) makes the trainer, not the
    prefetching DataLoader, the source of truth for where an epoch resumes. ``transform`` is a
    batched augmentation called as ``transform(x, seed, offset, total)``: ``seed`` is the step's,
    ``total`` the global batch and ``offset`` this micro-batch's first row in it, so that a global
    batch split across ranks and micro-steps is augmented exactly as if it were processed whole.
    ``where`` follows the global batch in the error of a dataset that cannot fill one.
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
        where: str = "",
        **dataloader_kwargs: Any,
    ) -> None:
        self.sampler = GlobalBatchSampler(len(dataset), plan, rank, seed, shuffle, where)  # type: ignore[arg-type]
        self.plan, self.rank, self.device, self.seed = plan, rank, device, seed
        self.position = position or (lambda: self.sampler.position)
        self.transform = transform
        self.pin_memory = bool(dataloader_kwargs.get("pin_memory"))
        # A private generator: each new DataLoader iterator draws a worker base seed from it, which
        # would otherwise advance the global RNG (dropout) differently in a resumed run.
        dataloader_kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        self.dataloader = _batch_loader(dataset, self.sampler, dataloader_kwargs, seed)

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (from the global step): after a resume,
        ``for epoch in range(loader.epoch, epochs)`` continues the epoch loop, its first pass
        reading the rest of the interrupted epoch."""
        return self.position() // self.steps_per_epoch

    def __len__(self) -> int:
        self.sampler.set_position(self.position())
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        start = self.position()
        self.sampler.set_position(start)
        p = self.plan
        on_cpu = self.device.type == "cpu"  # batches are read on the CPU: no copy to make
        for i, batch in enumerate(_read(self.dataloader)):
            if not on_cpu:
                batch = to_device(batch, self.device, non_blocking=self.pin_memory)
            if self.transform is not None:
                step, micro = start + i // p.accumulation, i % p.accumulation
                # the draws of the whole global batch, from the step alone: this micro-batch's rows of
                # it (micro-step chunk, then rank slice, as the sampler lays them), whatever W and A
                chunk = p.global_batch // p.accumulation
                x = self.transform(batch[0], step_seed(self.seed, step, 0), micro * chunk + self.rank * p.micro_batch,
                                   p.global_batch)
                batch = (x, *batch[1:])
            yield batch


class StridedStream(IterableDataset):
    """Every ``world_size``-th sample of ``dataset`` from ``rank`` on: one rank's share of an
    evaluation stream (each sample once across ranks); DataLoader workers split it again."""

    def __init__(self, dataset: IterableDataset, world_size: int, rank: int) -> None:
        self.dataset, self.world_size, self.rank = dataset, world_size, rank

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is not None:
            # This copy lives in one worker: remember its share, and let the dataset read as if
            # alone. One that splits by worker itself (torch's documented pattern, HuggingFace's
            # IterableDataset) would otherwise be split twice, and samples never evaluated.
            self._share = (info.id, info.num_workers)
            _worker_state._worker_info = None
        worker, workers = getattr(self, "_share", (0, 1))
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
        self.dataset = dataset
        self.collate_fn = dataloader_kwargs.get("collate_fn") or default_collate
        # each DataLoader iterator draws a seed: from this generator, not the global RNG (dropout's)
        dataloader_kwargs.setdefault("generator", torch.Generator().manual_seed(0))
        self.stream = isinstance(dataset, IterableDataset)
        if self.stream:
            self.dataloader = DataLoader(StridedStream(dataset, world_size, rank), batch_size=batch_size,  # type: ignore[arg-type]
                                         **dataloader_kwargs)
        else:
            self.sampler = ShardedEvalSampler(len(dataset), world_size, rank)  # type: ignore[arg-type]
            batches = BatchSampler(self.sampler, batch_size, drop_last=False)
            self.dataloader = _batch_loader(dataset, batches, dataloader_kwargs)

    def __len__(self) -> int:
        if self.stream:
            raise TypeError("an evaluation stream has no length: iterate it")
        return len(self.dataloader)

    def first_sample(self) -> Any:
        """The evaluation set's first sample as a batch of one, on the CPU (a padding forward)."""
        first = next(iter(self.dataset)) if self.stream else self.dataset[0]
        return self.collate_fn([first])

    def __iter__(self) -> Iterator[Any]:
        for batch in _read(self.dataloader):
            batch = to_device(batch, self.device)
            if self.transform is not None:
                batch = (self.transform(batch[0]), *batch[1:])
            yield batch
