"""Global-batch samplers: the data order depends on (seed, epoch, step), never on the world size.

The user sets the *global* batch ``B`` (samples per optimizer step). With ``W`` data-parallel ranks
and ``A`` accumulation steps, each rank sees micro-batches of ``m = B / (W * A)``. Epoch ``e`` is a
permutation of the dataset drawn from ``(seed, e)``; optimizer step ``s`` takes positions
``[s*B, (s+1)*B)`` of it; micro-step ``a`` of that step takes the contiguous chunk
``[a*B/A, (a+1)*B/A)`` and rank ``r`` the ``r``-th slice of ``m`` samples in that chunk. So:

* every rank gets the same number of micro-batches (no hang on an uneven tail);
* the set of samples in each optimizer step — and in each micro-step across ranks, which is what
  SyncBatchNorm sees — is identical at world size 1, 2 or 8;
* the position is just the global step, so resuming mid-epoch on another world size is exact.

The tail that does not fill a whole global batch (``N mod B`` samples) is dropped for that epoch,
like ``drop_last=True``; a new permutation every epoch means a different tail each time. It is
never padded with duplicates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from ..env.seeding import mix_seed

__all__ = ["BatchPlan", "GlobalBatchSampler", "ShardedEvalSampler", "epoch_permutation", "check_dataset_fits",
           "full_batches"]


def check_dataset_fits(dataset_size: int, global_batch: int, where: str = "") -> None:
    """Refuse a data set that cannot fill one global batch (it would train no step), in one line.

    The one such check, made by :meth:`BatchPlan.steps_per_epoch` (the sampler, so every
    ``train_loader``; ``paratrain train`` before it starts workers; the parameter server) and bench's
    matrix (as a cell's skip reason). ``where`` follows the batch in the message, e.g.
    ``" over 4 process(es)"``.
    """
    if dataset_size < global_batch:
        raise ValueError(f"the dataset has {dataset_size} samples, fewer than one global batch of {global_batch}"
                         f"{where}: lower the global batch or use more data")


def full_batches(dataset_size: int, global_batch: int) -> int:
    """Global batches that ``dataset_size`` samples fill: the optimizer steps of one epoch (the tail
    is dropped). :meth:`BatchPlan.steps_per_epoch` is this after :func:`check_dataset_fits`."""
    return dataset_size // global_batch


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch splits into micro-batches: ``global_batch = micro_batch * world * accumulation``."""

    global_batch: int
    world_size: int
    accumulation: int
    micro_batch: int

    @classmethod
    def derive(
        cls,
        global_batch: int,
        world_size: int,
        accumulation: int | None = None,
        micro_batch: int | None = None,
    ) -> "BatchPlan":
        """Derive the micro-batch (and accumulation, when ``micro_batch`` caps it) from the global batch."""
        if global_batch < 1:
            raise ValueError(f"global batch {global_batch} must be at least 1")
        if accumulation is not None and accumulation < 1:
            raise ValueError(f"accumulation {accumulation} must be at least 1")
        if accumulation is None and micro_batch is not None:
            if micro_batch < 1:
                raise ValueError(f"micro batch {micro_batch} must be at least 1")
            per_rank, rest = divmod(global_batch, world_size)
            if rest or per_rank % micro_batch:
                raise ValueError(
                    f"global batch {global_batch} is not divisible by world size {world_size} × micro "
                    f"batch {micro_batch}: pick a global batch that is a multiple of {world_size * micro_batch}"
                )
            accumulation = per_rank // micro_batch
        accumulation = accumulation or 1
        split = world_size * accumulation
        if global_batch % split:
            raise ValueError(
                f"global batch {global_batch} is not divisible by world size {world_size} × accumulation "
                f"{accumulation} = {split}: pick a global batch that is a multiple of {split}"
            )
        plan = cls(global_batch, world_size, accumulation, global_batch // split)
        if micro_batch is not None and plan.micro_batch != micro_batch:
            raise ValueError(
                f"micro batch {micro_batch} contradicts global batch {global_batch} / (world {world_size} "
                f"× accumulation {accumulation}) = {plan.micro_batch}: set only two of the three"
            )
        return plan

    def steps_per_epoch(self, dataset_size: int, where: str = "") -> int:
        """Optimizer steps in one epoch of ``dataset_size`` samples (the tail that does not fill a
        global batch is dropped); a data set that cannot fill one is refused (:func:`check_dataset_fits`)."""
        check_dataset_fits(dataset_size, self.global_batch, where)
        return full_batches(dataset_size, self.global_batch)

    def __str__(self) -> str:
        return (f"{self.global_batch} = {self.micro_batch} per worker x {self.world_size} data-parallel workers "
                f"x {self.accumulation} accumulation")


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The global sample order of one epoch: a function of (seed, epoch) only."""
    if not shuffle:
        return torch.arange(n)
    g = torch.Generator()
    g.manual_seed(mix_seed(seed, epoch))  # any seed: the same order as before where it fitted
    return torch.randperm(n, generator=g)


class EpochIndices(list):
    """One micro-batch's dataset indices (a plain list to the DataLoader), tagged with the epoch
    they belong to: what :class:`~paratrain.data.loaders.SeededSamples` seeds each sample by."""

    epoch: int

    def __init__(self, indices: list[int], epoch: int) -> None:
        super().__init__(indices)
        self.epoch = epoch


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches of dataset indices, epoch after epoch, with no ``set_epoch``.

    Each call to ``iter()`` plays one epoch, starting at :attr:`position` and then moving on to
    the next epoch, so a plain ``for epoch in range(E): for batch in loader:`` gets a fresh order
    every epoch. :meth:`set_position` (or :meth:`load_state_dict`) moves it to any global step.
    """

    def __init__(
        self,
        dataset_size: int,
        plan: BatchPlan,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        where: str = "",
    ) -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside world size {plan.world_size}")
        self.steps_per_epoch = plan.steps_per_epoch(dataset_size, where)
        self.n = dataset_size
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._step_in_epoch = 0

    # --- position -------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Global optimizer step at which the next ``iter()`` starts."""
        return self._epoch * self.steps_per_epoch + self._step_in_epoch

    def set_position(self, global_step: int) -> None:
        self._epoch, self._step_in_epoch = divmod(int(global_step), self.steps_per_epoch)

    def state_dict(self) -> dict[str, int]:
        return {"global_step": self.position, "seed": self.seed, "global_batch": self.plan.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("global_batch", self.plan.global_batch) != self.plan.global_batch:
            raise ValueError(
                f"checkpoint was written with global batch {state['global_batch']}, this run uses "
                f"{self.plan.global_batch}: resume with the same global batch"
            )
        self.seed = state.get("seed", self.seed)
        self.set_position(state["global_step"])

    # --- iteration ------------------------------------------------------------------------
    def micro_batches(self, epoch: int, start_step: int = 0) -> Iterator[list[int]]:
        """This rank's micro-batches for ``epoch`` from ``start_step`` on (a pure function), each
        an :class:`EpochIndices`."""
        return (EpochIndices(rows.tolist(), epoch) for rows in self.micro_batch_rows(epoch, start_step))

    def micro_batch_rows(self, epoch: int, start_step: int = 0) -> Iterator[torch.Tensor]:
        """:meth:`micro_batches` as int64 tensors (views of the epoch's permutation: no copy)."""
        p = self.plan
        perm = epoch_permutation(self.n, self.seed, epoch, self.shuffle)
        chunk = p.global_batch // p.accumulation
        for step in range(start_step, self.steps_per_epoch):
            base = step * p.global_batch
            for a in range(p.accumulation):
                lo = base + a * chunk + self.rank * p.micro_batch
                yield perm[lo : lo + p.micro_batch]

    def micro_batch_arrays(self, epoch: int, start_step: int = 0) -> Iterator[tuple[int, Any]]:
        """:meth:`micro_batches` as ``(epoch, int64 NumPy array)`` (views: no copy)."""
        perm = epoch_permutation(self.n, self.seed, epoch, self.shuffle).numpy()
        p = self.plan
        chunk = p.global_batch // p.accumulation
        for step in range(start_step, self.steps_per_epoch):
            base = step * p.global_batch
            for a in range(p.accumulation):
                lo = base + a * chunk + self.rank * p.micro_batch
                yield epoch, perm[lo : lo + p.micro_batch]

    def __iter__(self) -> Iterator[list[int]]:
        return self._play(self.micro_batches)

    def iter_arrays(self) -> Iterator[tuple[int, Any]]:
        """``iter()`` with each micro-batch as ``(epoch, int64 NumPy array)`` (:meth:`micro_batch_arrays`)."""
        return self._play(self.micro_batch_arrays)

    def iter_rows(self) -> Iterator[torch.Tensor]:
        """``iter()`` with each micro-batch as an int64 tensor (:meth:`micro_batch_rows`)."""
        return self._play(self.micro_batch_rows)

    def _play(self, batches: Any) -> Iterator[Any]:
        """One epoch of ``batches(epoch, start_step)`` from :attr:`position`; the position moves to
        the next epoch once iteration starts."""
        epoch, start = self._epoch, self._step_in_epoch

        def play() -> Iterator[Any]:
            # Advance when iteration really starts, not at iter(): a DataLoader with workers calls
            # iter() twice and drops the first iterator. Prefetching workers run ahead, so
            # "consumed" is tracked by the trainer (see set_position); the next epoch is next.
            self._epoch, self._step_in_epoch = epoch + 1, 0
            yield from batches(epoch, start)

        return play()

    def __len__(self) -> int:
        return (self.steps_per_epoch - self._step_in_epoch) * self.plan.accumulation


class ShardedEvalSampler(Sampler[int]):
    """Evaluation shard: contiguous, uneven when it must be, never padded — each sample is counted
    exactly once when per-rank sums are all-reduced."""

    def __init__(self, dataset_size: int, world_size: int = 1, rank: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.start = dataset_size * rank // world_size
        self.stop = dataset_size * (rank + 1) // world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start
