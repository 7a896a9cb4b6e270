"""Streaming data (``IterableDataset``): the same global batches at any world size, no hang at the end.

Two kinds of stream:

* A :class:`~.shards.ShardedStream` (files, URLs, table fragments, each read by ``read(source)``):
  its shards' lengths are known (given, read from an index, or counted once and cached), so its
  global order is arithmetic (:mod:`paratrain.data.shards`): every sample of every shard, whatever
  their lengths, the same steps at every world size, and a resumed run opens each shard at its
  position.
* A plain ``IterableDataset`` is one shard of unknown length, read by every rank: global batch ``s``
  is its samples ``[s*B, (s+1)*B)``; rank ``r`` of ``W`` keeps the contiguous positions
  ``[r*B/W, (r+1)*B/W)``, micro-step ``a`` the ``a``-th ``m`` of them. The stream ends at the first
  global batch it cannot fill: before each step the ranks agree (one all-reduce of one number)
  whether all of them have it. A resumed run finds its place by reading up to its step, unless the
  stream keeps its own position: one with ``state_dict()``/``load_state_dict()`` (HuggingFace's
  streamed ``IterableDataset``, torchdata's stateful datasets) is opened at the state it had at the
  checkpoint's step, which the checkpoint holds; and a run saved between two passes starts the next
  pass without reading.

So every optimizer step holds the same samples at world size 1, 2 or 4. (Without accumulation a
micro-step's samples are the same too; with it, unlike the map-style sampler, which samples share
a micro-step — what BatchNorm sees — follows the ranks.) DataLoader workers split the rank's
micro-batches round-robin (worker ``w`` of ``n`` collates micro-batches ``w, w+n, ...``), so no
sample is duplicated and the order is kept; each worker reads the rank's shards itself. Each pass
over the loader is a pass over the stream (``set_epoch(epoch)`` is called on the dataset when it
has one).
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info
from torch.utils.data._utils import worker as _worker_state

from .batch import to_device
from .sampler import BatchPlan
from .shards import ShardedStream, ShardOrder, ShardReader, lengths_digest, resolve_lengths

__all__ = ["ShardedStream", "RankStream", "ShardedRankStream", "StreamLoader", "refuse_split_by_node"]


class Stamped(NamedTuple):
    """A micro-batch of a stream that keeps its own position, with the stream's ``state_dict()``
    once its step's global batch is read: the pass's steps read (``step``) and that state."""
    batch: Any
    step: int
    state: Any


class RankStream(IterableDataset):
    """One rank's micro-batches of a plain stream (one shard of unknown length, read by every rank),
    collated by ``collate``, from step ``skip`` of a pass on (the steps before are read and dropped).
    The dataset opens at step ``first`` of the pass (it was loaded from its own state there). With
    ``stamp``, each micro-batch comes as :class:`Stamped`. In a DataLoader worker, only that
    worker's share of the micro-batches."""

    def __init__(self, dataset: IterableDataset, plan: BatchPlan, rank: int, skip: int = 0, epoch: int = 0,
                 collate: Callable[[list[Any]], Any] | None = None, stamp: bool = False, first: int = 0) -> None:
        self.dataset, self.plan, self.rank, self.skip, self._epoch = dataset, plan, rank, skip, epoch
        self.collate, self.stamp, self.first = collate or default_collate, stamp, first
        share = plan.global_batch // plan.world_size  # this rank's contiguous positions of each global batch
        self.positions = range(rank * share, (rank + 1) * share)

    def tell_epoch(self) -> None:
        """Tell the dataset its pass (``set_epoch``, where it has one), in the process that makes the pass, before
        its DataLoader starts workers; never in the workers. They would call it at once, and HuggingFace's epoch is
        a counter in shared memory that ``set_epoch`` moves by a difference: two workers moving it together made
        pass 1 pass 2, and one worker read its shards in pass 2's shuffled order."""
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self._epoch)

    def count_steps(self, limit: int) -> int:
        """How many global batches this pass holds, up to ``limit`` (reads them)."""
        self.tell_epoch()
        reader = iter(self.dataset)
        n = 0
        while n < limit and len(list(islice(reader, self.plan.global_batch))) == self.plan.global_batch:
            n += 1
        return n

    def __iter__(self) -> Iterator[Any]:
        worker, workers = _own_worker()
        reader = iter(self.dataset)  # its epoch was told by the process that made this pass (tell_epoch)
        p, step, micro = self.plan, self.first, 0
        while True:
            batch = list(islice(reader, p.global_batch))
            if len(batch) < p.global_batch:
                return  # the stream ends before this global batch is full
            if step >= self.skip:
                mine = batch[self.positions.start:self.positions.stop]
                state = None  # the stream's state after this global batch, asked once by a worker that yields of it
                for a in range(p.accumulation):
                    if micro % workers == worker:
                        out = self.collate(mine[a * p.micro_batch:(a + 1) * p.micro_batch])
                        if self.stamp:
                            state = self.dataset.state_dict() if state is None else state  # type: ignore[attr-defined]
                            out = Stamped(out, step + 1, state)
                        yield out
                    micro += 1
            step += 1


def refuse_split_by_node(dataset: Any, what: str) -> None:
    """A HuggingFace stream already split between the ranks (``datasets.distributed.split_dataset_by_node``) would
    be split again by paratrain, which reads the whole stream on every rank and keeps each rank's share of every
    global batch: most samples would be lost. Refused in one line."""
    split = getattr(dataset, "_distributed", None)
    world = getattr(split, "world_size", 1)
    if isinstance(world, int) and world > 1:
        raise ValueError(f"{what}: the stream was split by split_dataset_by_node (rank {getattr(split, 'rank', '?')} of "
                         f"{world}); paratrain shares a stream out between the ranks itself (the same samples at any "
                         "world size): pass the dataset before split_dataset_by_node")


def own_position(dataset: Any) -> str | None:
    """Why ``dataset`` (a plain stream) cannot be opened at its own saved position, or None when it
    can: it keeps its position (``state_dict()``/``load_state_dict()``, as torchdata's ``Stateful``),
    and nothing of it lies outside that state (HuggingFace's shuffle buffer does)."""
    if not (callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))):
        return "a plain IterableDataset cannot seek: a ShardedStream with known lengths, or a dataset with " \
               "state_dict()/load_state_dict(), opens at its position"
    stack, seen = [getattr(dataset, "_ex_iterable", None)], 0
    while stack and seen < 1000:  # HuggingFace's chain of example iterables
        part = stack.pop()
        seen += 1
        if part is None:
            continue
        if type(part).__name__ == "BufferShuffledExamplesIterable":
            return "the samples in its shuffle buffer (shuffle(buffer_size=...)) are not in its state_dict()"
        stack += [getattr(part, "ex_iterable", None), *(getattr(part, "ex_iterables", None) or [])]
    return None


class ShardedRankStream(IterableDataset):
    """One rank's samples of a :class:`~.shards.ShardedStream` for steps ``[start, stop)``, in
    micro-batch order, read where :class:`~.shards.ShardOrder` puts them; in a DataLoader worker,
    only that worker's share of the micro-batches."""

    def __init__(self, stream: ShardedStream, order: ShardOrder, plan: BatchPlan, rank: int, start: int,
                 stop: int) -> None:
        self.stream, self.order, self.plan, self.rank, self.start, self.stop = stream, order, plan, rank, start, stop

    def __iter__(self) -> Iterator[Any]:
        worker, workers = _own_worker()
        reader, p, micro = ShardReader(self.stream), self.plan, 0
        for step in range(self.start, self.stop):
            for segments in self.order.micro_batches(step, self.rank, p.world_size, p.accumulation):
                if micro % workers == worker:
                    for seg in segments:
                        yield from reader.take(seg)
                micro += 1


def _own_worker() -> tuple[int, int]:
    """This DataLoader worker's number and the number of workers ((0, 1) outside one). paratrain
    splits the micro-batches between workers: the dataset must read as if alone. One that splits by
    worker itself (HuggingFace's IterableDataset does) would otherwise hand this worker a part of
    the stream, and samples would be lost. This process is the DataLoader's worker for this pass
    only (streams get no persistent workers)."""
    info = get_worker_info()
    if info is None:
        return 0, 1
    _worker_state._worker_info = None
    return info.id, info.num_workers


class StreamLoader:
    """A rank's micro-batches of a stream, on the device, with every rank running the same steps.

    ``min_all(n)`` is a collective returning the smallest ``n`` over all ranks, ``gather_max(ns)``
    the elementwise largest of a list over all ranks; ``position`` returns the global optimizer
    step (the trainer's, as for map-style loaders); ``say`` prints on the main process.

    A :class:`~.shards.ShardedStream` gets its shards' lengths first (given, cached, or counted:
    a collective) and is then pure arithmetic: every pass's steps are known, a resumed run opens
    each shard at its position. A plain ``IterableDataset`` is one shard of unknown length: the
    ranks agree before each step whether all of them have it, and a resumed run reads up to its step.
    """

    def __init__(self, dataset: IterableDataset, plan: BatchPlan, rank: int, device: torch.device,
                 min_all: Callable[[int], int], position: Callable[[], int],
                 gather_max: Callable[[list[int]], list[int]] | None = None,
                 say: Callable[[str], None] | None = None, **dataloader_kwargs: Any) -> None:
        self.dataset, self.plan, self.rank, self.device = dataset, plan, rank, device
        self.min_all, self.position = min_all, position
        self.say = say or (lambda line: None)
        self.pin_memory = bool(dataloader_kwargs.get("pin_memory"))
        dataloader_kwargs.pop("persistent_workers", None)  # each pass is a new stream object: new workers
        self.dataloader_kwargs = dataloader_kwargs
        self.order: ShardOrder | None = None
        if isinstance(dataset, ShardedStream):
            gather = gather_max or (lambda ns: list(ns))
            lengths = resolve_lengths(dataset, rank, plan.world_size, gather, self.say)
            dataset._resolved = lengths  # type: ignore[attr-defined]  # named in the error of a shard that ends early
            self.order = ShardOrder(lengths, dataset.readers, plan.global_batch, dataset.tail, dataset.shuffle,
                                    dataset.seed)
            if self.order.dropped:
                n = self.order.dropped
                self.say(f"paratrain stream: each pass holds {self.order.total:,} samples, "
                         f"{self.order.steps_per_pass:,} global batches of {plan.global_batch}; its last {n} "
                         f"sample{'s are' if n > 1 else ' is'} not trained (ShardedStream(tail='next') opens the next "
                         "pass with them)")
        self._epoch = 0  # passes completed over the stream
        self.pass_start = 0  # the global step at which the current pass began
        self._located = False
        # a plain stream's own position: why it cannot be opened there (None: it can), where it stood after
        # the newest step read, and the step of its pass it was opened at (loaded from that position)
        self._why_not_own = own_position(dataset) if self.order is None else None
        self._mark: dict[str, Any] | None = None
        self._opened: tuple[int, int, Any] | None = None  # (pass, its step, the dataset's state) a resumed run opens at
        self.resumed: Callable[[], dict[str, Any] | None] = lambda: None  # the checkpoint's state (StreamState)

    def state(self) -> dict[str, Any]:
        """What identifies this stream's order, and for a plain stream where it stands when it can
        be opened there (kept in a checkpoint beside the global step)."""
        if self.order is None:
            source = self._source()
            return {"kind": "stream", **({"source": source} if source is not None else {})}
        o = self.order
        return {"kind": "sharded", "shards": len(o.lengths), "samples": o.total, "lengths": lengths_digest(o.lengths),
                "readers": o.readers, "tail": o.tail, "shuffle": o.shuffle, "seed": o.seed}

    @property
    def epoch(self) -> int:
        """The pass over the stream the next batch belongs to: after a resume, ``for epoch in
        range(loader.epoch, epochs)`` continues the epoch loop. For a plain stream, after a resume,
        the first read (or iteration) finds the pass by counting the stream's steps up to the global
        step, a collective: read it on every rank."""
        if self.order is not None:
            return self.order.epoch_of_step(self.position())
        self._locate_once()
        return self._epoch

    def _locate_once(self) -> None:
        if not self._located:
            self._locate(self.position())
            self._located = True

    @property
    def steps_per_epoch(self) -> int:
        if self.order is not None and self.order.steps_per_pass is not None:
            return self.order.steps_per_pass
        if self.order is not None:
            raise TypeError("a stream with tail='next' has passes of varying steps: train for a number of steps")
        raise TypeError("a stream has no known number of steps per epoch: train for a number of steps")

    def __len__(self) -> int:
        if self.order is None:
            raise TypeError("a stream has no length: train for a number of steps (while pt.global_step < steps)")
        start = self.position()
        e = self.order.epoch_of_step(start)
        return (self.order.first_step(e + 1) - start) * self.plan.accumulation

    def _source(self) -> dict[str, Any] | None:
        """Where a plain stream stands at the global step, if a resumed run can start there without
        reading: the pass, its first step, and the dataset's own state (None: the pass's start)."""
        at = self.position()
        if not self._located:  # nothing read yet: a resumed run's position holds until it reads
            saved = (self.resumed() or {}).get("source")
            if saved is not None and saved.get("step") == at:
                return saved
            return {"epoch": 0, "pass_start": 0, "step": 0, "state": None} if at == 0 else None
        if at == self.pass_start:
            return {"epoch": self._epoch, "pass_start": at, "step": at, "state": None}
        mark = self._mark
        return mark if mark is not None and mark["step"] == at else None

    def _locate(self, position: int) -> None:
        """Find the pass and its first step for a run that starts at ``position`` (a resumed one).
        Where the checkpoint holds the stream's position there, open it there: a pass's start, or the
        dataset's own state. Otherwise count each pass's steps (the same on every rank) until the pass
        that holds ``position``: that reads the stream up to there."""
        saved = (self.resumed() or {}).get("source")
        if position > 0 and saved is not None and saved.get("step") == position:
            if saved["state"] is None or self._why_not_own is None:
                self._epoch, self.pass_start = int(saved["epoch"]), int(saved["pass_start"])
                if saved["state"] is not None:
                    self._opened = (self._epoch, position - self.pass_start, saved["state"])
                    self.say(f"paratrain stream: resuming at step {position:,} opens the stream at its own "
                             f"state_dict() (step {self._opened[1]:,} of pass {self._epoch}), without reading")
                return
        skip = position
        if skip > 0:
            why = self._why_not_own or "the checkpoint holds no position of the stream at its step"
            self.say(f"paratrain stream: resuming at step {position:,} reads the stream up to there ({why})")
        while skip > 0:
            n = self.min_all(RankStream(self.dataset, self.plan, self.rank, 0, self._epoch).count_steps(skip + 1))
            if n > skip:
                break  # position lies inside this pass
            if n == 0:
                raise ValueError(f"the stream holds no complete global batch of {self.plan.global_batch} samples "
                                 f"in pass {self._epoch}: cannot resume at step {position}")
            skip, self.pass_start, self._epoch = skip - n, self.pass_start + n, self._epoch + 1

    def _loader(self, stream: IterableDataset, epoch: int) -> Iterator[Any]:
        # A generator of the pass's own: each DataLoader iterator draws a seed from one, from the
        # global RNG (dropout's) without it, and a resumed run would then draw once more.
        kwargs = {"generator": torch.Generator().manual_seed(epoch), **self.dataloader_kwargs}
        if isinstance(stream, RankStream):  # it collates its micro-batches itself
            return iter(DataLoader(stream, batch_size=None, **{**kwargs, "collate_fn": _as_is}))
        return iter(DataLoader(stream, batch_size=self.plan.micro_batch, drop_last=True, **kwargs))

    def _plain_pass(self, skip: int) -> RankStream:
        """The rest of a pass over a plain stream from its step ``skip``. In the pass a resumed run opened at the
        dataset's own state, every iteration opens there again (a loop that broke off and iterates anew): the state is
        loaded each time, and the steps before it are not in the stream."""
        first = 0
        if self._opened is not None and self._opened[0] == self._epoch:
            self.dataset.load_state_dict(self._opened[2])  # type: ignore[attr-defined]
            first = self._opened[1]
        stream = RankStream(self.dataset, self.plan, self.rank, skip, self._epoch,
                            self.dataloader_kwargs.get("collate_fn"), stamp=self._why_not_own is None, first=first)
        stream.tell_epoch()
        return stream

    def __iter__(self) -> Iterator[Any]:
        if self.order is not None:
            yield from self._sharded_pass()
            return
        self._locate_once()
        p = self.plan
        while True:
            start = self.position()
            skip = start - self.pass_start
            batches = self._loader(self._plain_pass(skip), self._epoch)
            steps = 0
            while True:
                step = list(islice(batches, p.accumulation))  # the whole step first: then agree, then train
                if self.min_all(int(len(step) == p.accumulation)) == 0:
                    break
                if step and isinstance(step[-1], Stamped):  # where the stream stands once this step is trained
                    self._mark = {"epoch": self._epoch, "pass_start": self.pass_start,
                                  "step": self.pass_start + step[-1].step, "state": step[-1].state}
                    step = [b.batch for b in step]
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

    def _sharded_pass(self) -> Iterator[Any]:
        """The rest of the pass the global step lies in: its steps are known on every rank."""
        order, p = self.order, self.plan
        assert order is not None and isinstance(self.dataset, ShardedStream)
        start = self.position()
        epoch = order.epoch_of_step(start)
        stop = order.first_step(epoch + 1)
        if start > order.first_step(epoch) and self.dataset.seek is None and not self._located:
            first = [seg for micro in order.micro_batches(start, 0, p.world_size, p.accumulation) for seg in micro]
            if any(seg.start for seg in first):
                self.say(f"paratrain stream: resuming at step {start:,} reads each open shard from its start to its "
                         "position (give ShardedStream a seek= to open a shard at a sample)")
        self._located = True
        stream = ShardedRankStream(self.dataset, order, p, self.rank, start, stop)
        for batch in self._loader(stream, epoch):
            yield to_device(batch, self.device, non_blocking=self.pin_memory)


def _as_is(batch: Any) -> Any:
    """The collate of a DataLoader over a :class:`RankStream`, which yields micro-batches."""
    return batch


class StreamState:
    """The identity of the stream a run trains on, kept in its checkpoints beside the global step:
    a resumed run on other shards, lengths, readers or tail would read other samples at the same
    step, so it is refused in one line. (A map-style data set's identity is its size, checked by
    the sampler; a plain stream has none to check.)"""

    def __init__(self) -> None:
        self.loader: StreamLoader | None = None  # the newest stream loader
        self.saved: dict[str, Any] | None = None  # the state a resumed checkpoint holds

    @property
    def current(self) -> dict[str, Any] | None:
        """The newest stream loader's state now (where a plain stream stands moves with the step)."""
        return None if self.loader is None else self.loader.state()

    def made(self, loader: Any) -> Any:
        """``loader`` was made for this run: remember its stream and check it against a resumed one."""
        if isinstance(loader, StreamLoader):
            self.loader = loader
            loader.resumed = lambda: self.saved
            self._check()
        return loader

    def resumed(self, saved: dict[str, Any] | None) -> None:
        self.saved = saved
        self._check()

    def _check(self) -> None:
        saved, now = self.saved, self.current
        if saved is None or now is None or saved.get("kind") != "sharded" or now.get("kind") != "sharded":
            return
        differ = [k for k in ("shards", "samples", "lengths", "readers", "tail", "shuffle", "seed") if saved.get(k) != now.get(k)]
        if differ:
            said = ", ".join(f"{k} {saved.get(k)} now {now.get(k)}" for k in differ)
            raise ValueError(f"the checkpoint was written on another stream ({said}): resume on the same shards and "
                             "ShardedStream settings, or start a new run")
