"""A dataset or a user's own DataLoader made into this rank's training or evaluation loader.

What :meth:`Parallel.train_loader <paratrain.Parallel.train_loader>` and ``eval_loader`` do: a
map-style dataset gets the global-batch sampler (:class:`~.loaders.GlobalBatchLoader`), a stream
the same global batches at any world size (:class:`~.stream.StreamLoader`); a DataLoader gives its
dataset (the part its sampler selects) and its worker settings, and its sampler and batch size are
replaced.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .from_loader import loader_samples
from .loaders import EvalLoader, GlobalBatchLoader
from .sampler import BatchPlan
from .stream import StreamLoader, refuse_split_by_node

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # torch's own dependency; only the type checker reads it

__all__ = ["train_loader", "eval_loader", "loader_settings"]

# What train_loader keeps of a user's DataLoader (its sampler, batch size and drop_last are paratrain's;
# in_order too: batches out of order would make a step's samples depend on the workers' timing).
_KEPT_LOADER_SETTINGS = ("collate_fn", "num_workers", "pin_memory", "worker_init_fn", "persistent_workers", "timeout",
                         "prefetch_factor", "multiprocessing_context", "pin_memory_device")
_USER = 5  # warnings' stacklevel: the user's call of Parallel.train_loader


def is_dataset(obj: Any) -> TypeIs[Dataset | DataLoader]:
    """Whether ``obj`` is data to shard (a ``DataLoader``, a torch ``Dataset``, or a map-style
    dataset of another library: HuggingFace's ``datasets.Dataset``), not an iterable of batches
    already made (a list of batches, an :class:`~paratrain.data.loaders.EvalLoader`)."""
    if isinstance(obj, (EvalLoader, GlobalBatchLoader, StreamLoader)):
        return False
    if isinstance(obj, (DataLoader, Dataset)):
        return True
    return (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")
            and not isinstance(obj, (list, tuple, dict, str, bytes, torch.Tensor)))


def loader_settings(loader: DataLoader) -> dict[str, Any]:
    """The settings of a user's DataLoader that paratrain keeps (not its sampler or batch size)."""
    kept = {k: getattr(loader, k) for k in _KEPT_LOADER_SETTINGS if hasattr(loader, k)}
    if loader.num_workers == 0:  # DataLoader refuses these without workers
        kept.pop("prefetch_factor", None)
        kept.pop("persistent_workers", None)
    return kept


def train_loader(dataset: Dataset | DataLoader, plan: BatchPlan, rank: int, device: torch.device, seed: int, *,
                 position: Callable[[], int], reduce_max: Callable[[torch.Tensor], torch.Tensor], where: str = "",
                 transform: Callable[..., torch.Tensor] | None = None, shuffle: bool | None = None,
                 say: Callable[[str], None] | None = None, **dataloader_kwargs: Any) -> GlobalBatchLoader | StreamLoader:
    """Data-parallel rank ``rank``'s micro-batches under ``plan``, from the global step ``position()``
    on, epoch after epoch (what :meth:`paratrain.Parallel.train_loader` returns).

    ``dataset`` is a dataset, or your own :class:`~torch.utils.data.DataLoader`: its dataset,
    ``collate_fn``, ``num_workers``, ``pin_memory``, ``worker_init_fn``, ``persistent_workers``
    (and prefetch/timeout/multiprocessing settings) are kept, its sampler and batch size are
    replaced by paratrain's global-batch sampler over the samples its sampler selects (a
    ``SubsetRandomSampler``'s part of the dataset; one that draws samples twice is refused),
    and a ``batch_size`` other than the derived micro-batch is reported in one line.
    ``shuffle`` defaults to True, or for a DataLoader to whether its sampler was random.
    ``dataloader_kwargs`` go to the DataLoader and win over a given loader's settings; batch
    size and sampler are paratrain's.

    An :class:`~torch.utils.data.IterableDataset` (a stream of unknown length, or a
    :class:`~paratrain.data.stream.ShardedStream` of files) gives the same global batches at
    any world size and the same number of steps on every rank (see :mod:`paratrain.data.stream`).
    ``reduce_max`` is the strategy's all-reduce of the maximum over every rank (a collective: streams
    agree on their steps with it, and share a count of their shards' lengths); ``say`` prints a line on the main
    process (what a stream reports: its dropped tail, a count of its shards, a resume that re-reads); ``where`` follows the global batch in the one-line error of a dataset that
    cannot fill one.
    """
    for k in ("batch_size", "sampler", "batch_sampler", "drop_last"):
        if k in dataloader_kwargs:
            raise ValueError(f"train_loader sets {k!r} itself from the global batch: remove it")
    data: Dataset = dataset  # type: ignore[assignment]
    if isinstance(dataset, DataLoader):
        data, kept, shuffle = _from_dataloader(dataset, plan, shuffle)
        dataloader_kwargs = {**kept, **dataloader_kwargs}
    if isinstance(data, IterableDataset):
        refuse_split_by_node(data, "train_loader")
        if transform is not None or shuffle:
            raise ValueError("a stream (IterableDataset) is read in order, without transform: shuffle or "
                             "augment inside the dataset")
        def min_all(n: int) -> int:  # the smallest n over every rank
            return -int(reduce_max(torch.tensor([-n], dtype=torch.int64, device=device)).item())

        def gather_max(ns: list[int]) -> list[int]:  # the elementwise largest over every rank
            return [int(n) for n in reduce_max(torch.tensor(ns, dtype=torch.int64, device=device)).tolist()]

        return StreamLoader(data, plan, rank, device, min_all, position=position, gather_max=gather_max,
                            say=say or print, **dataloader_kwargs)
    return GlobalBatchLoader(data, plan, rank, device, seed, position=position, transform=transform,
                             shuffle=True if shuffle is None else shuffle, where=where, **dataloader_kwargs)


def _from_dataloader(loader: DataLoader, m: BatchPlan, shuffle: bool | None) -> tuple[Any, dict[str, Any], bool | None]:
    """The dataset and settings of a user's DataLoader that paratrain keeps, and its shuffle."""
    kept = loader_settings(loader)
    if loader.batch_size is not None and loader.batch_size != m.micro_batch:
        warnings.warn(f"train_loader: the DataLoader's batch_size {loader.batch_size} is replaced by the micro-batch "
                      f"{m.micro_batch} (global batch {m.global_batch} = {m.micro_batch} × {m.world_size} processes "
                      f"× {m.accumulation} accumulation steps)", stacklevel=_USER)
    dataset, random_order = loader_samples(loader, "train_loader")
    if shuffle is None and not isinstance(dataset, IterableDataset):
        shuffle = random_order
        if random_order is None:
            sampler = loader.sampler if loader.batch_size is not None else loader.batch_sampler
            warnings.warn(f"train_loader: the DataLoader's {type(sampler).__name__} is replaced by paratrain's "
                          "global-batch sampler over the samples it gives (shuffled: pass shuffle=False for their "
                          "order)", stacklevel=_USER)
    return dataset, kept, shuffle


def eval_loader(dataset: Dataset | DataLoader, batch_size: int | None, default_batch: int, shards: int, rank: int,
                device: torch.device, transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                **dataloader_kwargs: Any) -> EvalLoader:
    """Shard ``rank`` of ``shards`` of an evaluation set (see :meth:`paratrain.Parallel.eval_loader`);
    batches of ``batch_size``, else the DataLoader's, else ``default_batch``."""
    if isinstance(dataset, DataLoader):
        loader = dataset
        dataloader_kwargs = {**loader_settings(loader), **dataloader_kwargs}
        dataset, batch_size = loader_samples(loader, "eval_loader")[0], batch_size or loader.batch_size
    if isinstance(dataset, IterableDataset):
        refuse_split_by_node(dataset, "eval_loader")
    return EvalLoader(dataset, batch_size or default_batch, shards, rank, device, transform, **dataloader_kwargs)
