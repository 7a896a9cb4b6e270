"""Sharded streams: every sample of shards of any length, in one order at every world size, resumed by seeking.

A :class:`ShardedStream` is a list of *shards* (files, URLs, table fragments...), each read by
``read(source)``. Its global order does not depend on the world size or on the DataLoader workers:

* The shards (in their order, or shuffled per pass by ``(seed, pass)``) are dealt to ``readers``
  *virtual readers* (MosaicML's canonical nodes): reader ``v`` reads shards ``v, v+R, v+2R, ...``
  one after another, moving on to its next shard when one ends.
* The pass is the readers' samples taken round-robin: one from each reader that has samples left,
  in reader order; a reader whose shards are all read drops out of the rounds. So every sample of
  every shard is in the pass exactly once, whatever the shards' lengths (1, 7, 100, 0, 20...).
* Optimizer step ``s`` takes positions ``[s*B, (s+1)*B)`` of that order. Within the step its
  samples are grouped by reader (reader ``v``'s are a contiguous run of its samples), and rank
  ``r`` of ``W`` takes the ``r``-th ``B/W`` of them: with ``W`` dividing ``R`` a rank reads its own
  readers' files only, front to back; where two ranks share a reader's run, each reads (or seeks)
  past the other's part.
* The pass holds ``N // B`` steps; the ``N mod B`` samples that do not fill a global batch are
  dropped (``tail="drop"``, reported), or open the next pass's first step (``tail="next"``: the
  passes are one endless order, and every sample is trained once per pass over the run).

The order is arithmetic on the shards' lengths, so a resumed run (at any world size) computes
where each rank's samples are and opens each shard there: with ``seek(source, offset)`` (an
indexed format: a token file, Parquet row groups, an Arrow table) directly; without it, by reading
the shard from its start (and only that shard: never the steps before it). The lengths are given
(``lengths=``: a list, or a function of the source that reads an index or the format's metadata),
or counted once by reading every shard (the ranks share the shards) and cached beside the data
(``.paratrain-lengths.json``, keyed by each file's path, size and modification time and by the read
function), where they are read on the next run.
"""

from __future__ import annotations

import bisect
import json
import os
import zlib
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import torch
from torch.utils.data import IterableDataset

from ..env.seeding import mix_seed

__all__ = ["ShardedStream", "ShardOrder", "Segment", "ShardReader", "resolve_lengths", "DEFAULT_READERS"]

DEFAULT_READERS = 16  # virtual readers when not given: min(shards, this); never the world size's business
CACHE_NAME = ".paratrain-lengths.json"
Tail = Literal["drop", "next"]


class ShardedStream(IterableDataset):
    """A stream made of shards, each read by ``read(source)``: all of every shard, in an order that
    is the same at every world size (see :mod:`paratrain.data.shards`).

    ``lengths``: the samples in each shard: a list, or ``lengths(source)`` (an index, a format's
    metadata); ``None`` counts them once by reading and caches them beside the data (``cache``: a
    JSON file to use instead, or ``False`` for none). ``seek(source, offset)``, when given, iterates
    the shard from sample ``offset`` (a resumed run opens each shard at its position); without it a
    resume reads its shard from the start. ``readers``: virtual readers the shards are dealt to
    (default ``min(len(sources), 16)``; fix it for a data set: it defines the order). ``tail``:
    ``"drop"`` the samples of a pass that do not fill a global batch, or ``"next"`` to open the next
    pass with them. ``shuffle``: deal the shards in a new order each pass, from ``(seed, pass)``.

    Iterated by itself (outside paratrain) it yields the shards one after another.
    """

    def __init__(self, sources: Sequence[Any], read: Callable[[Any], Iterable[Any]], *,
                 lengths: Sequence[int] | Callable[[Any], int] | None = None,
                 seek: Callable[[Any, int], Iterable[Any]] | None = None, readers: int | None = None,
                 tail: Tail = "drop", shuffle: bool = False, seed: int = 0,
                 cache: str | os.PathLike | bool | None = None) -> None:
        if not sources:
            raise ValueError("ShardedStream needs at least one source")
        if tail not in ("drop", "next"):
            raise ValueError(f"tail={tail!r}: use 'drop' (the samples that do not fill a global batch are dropped) "
                             "or 'next' (they open the next pass)")
        if readers is not None and readers < 1:
            raise ValueError(f"readers={readers}: a stream needs at least one virtual reader")
        if isinstance(lengths, (list, tuple)) and len(lengths) != len(sources):
            raise ValueError(f"lengths has {len(lengths)} entries for {len(sources)} sources: give one per source")
        self.sources = list(sources)
        self.read = read
        self.lengths = lengths
        self.seek = seek
        self.readers = min(len(self.sources), readers or DEFAULT_READERS)
        self.tail: Tail = tail
        self.shuffle, self.seed = shuffle, seed
        self.cache = cache

    def __iter__(self) -> Iterator[Any]:
        for source in self.sources:
            yield from self.read(source)

    def open(self, k: int, offset: int) -> tuple[Iterator[Any], int]:
        """Shard ``k`` from sample ``offset``: the iterator and the samples read to get there."""
        if offset and self.seek is not None:
            return iter(self.seek(self.sources[k], offset)), 0
        it = iter(self.read(self.sources[k]))
        return it, _skip(it, offset)


def _skip(it: Iterator[Any], n: int) -> int:
    """Drop ``n`` samples of ``it``; how many there were."""
    return sum(1 for _ in islice(it, n))


# --- lengths ------------------------------------------------------------------------------------

def _file(source: Any) -> Path | None:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_file():
            return path.resolve()
    return None


def _reader_name(read: Callable[..., Any]) -> str:
    return f"{getattr(read, '__module__', '?')}.{getattr(read, '__qualname__', type(read).__qualname__)}"


def cache_path(stream: ShardedStream) -> Path | None:
    """Where the counted lengths are kept: ``cache`` when it is a path, else beside the first file
    when every source is a local file; None without one."""
    if stream.cache is False:
        return None
    if isinstance(stream.cache, (str, os.PathLike)):
        return Path(stream.cache)
    files = [_file(s) for s in stream.sources]
    if any(f is None for f in files):
        return None
    return files[0].parent / CACHE_NAME  # type: ignore[union-attr]


def _key(path: Path, read: str) -> str:
    st = path.stat()
    return f"{path}|{st.st_size}|{st.st_mtime_ns}|{read}"


def _cached(stream: ShardedStream, where: Path | None) -> list[int] | None:
    if where is None or not where.is_file():
        return None
    try:
        known = json.loads(where.read_text()).get("samples", {})
        read = _reader_name(stream.read)
        keys = [_key(f, read) if (f := _file(s)) is not None else repr(s) for s in stream.sources]
        got = [known.get(k) for k in keys]
    except (OSError, ValueError, AttributeError):
        return None
    return got if all(isinstance(n, int) for n in got) else None  # type: ignore[return-value]


def _store(stream: ShardedStream, where: Path, lengths: list[int]) -> str | None:
    """Keep ``lengths`` in ``where`` (merged with what it holds); the reason it could not, or None."""
    read = _reader_name(stream.read)
    try:
        known = json.loads(where.read_text()).get("samples", {}) if where.is_file() else {}
        for s, n in zip(stream.sources, lengths):
            f = _file(s)
            known[_key(f, read) if f is not None else repr(s)] = n
        tmp = where.with_name(where.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": 1, "samples": known}, indent=0))
        os.replace(tmp, where)
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def resolve_lengths(stream: ShardedStream, rank: int, world: int, gather_max: Callable[[list[int]], list[int]],
                    say: Callable[[str], None]) -> list[int]:
    """Every shard's number of samples, the same on every rank (a collective when counting):
    given, read from the cache, or counted (rank ``r`` reads shards ``r, r+W, ...``) and cached."""
    if isinstance(stream.lengths, (list, tuple)):
        lengths = [int(n) for n in stream.lengths]
    elif callable(stream.lengths):
        lengths = [int(stream.lengths(s)) for s in stream.sources]
    else:
        where = cache_path(stream)
        cached = _cached(stream, where)
        # every rank must take the same path: count unless every rank found the cache
        if gather_max([int(cached is None)])[0] == 0:
            return cached  # type: ignore[return-value]
        mine = [_skip(iter(stream.read(s)), 1 << 62) if k % world == rank else 0
                for k, s in enumerate(stream.sources)]
        lengths = gather_max(mine)
        if where is not None and rank == 0:
            failed = _store(stream, where, lengths)
            say(f"paratrain stream: counted the samples of {len(lengths)} shards ({sum(lengths):,} in all); "
                + (f"kept in {where}, read on the next run" if failed is None else
                   f"could not keep them in {where} ({failed}): pass ShardedStream(cache=PATH) or lengths="))
        elif rank == 0:
            say(f"paratrain stream: counted the samples of {len(lengths)} shards ({sum(lengths):,} in all) by reading "
                "them; they are not files, so nothing is cached: pass lengths= (or cache=PATH) to skip the count")
    bad = [(k, n) for k, n in enumerate(lengths) if n < 0]
    if bad:
        raise ValueError(f"shard {bad[0][0]} ({stream.sources[bad[0][0]]!r}) has length {bad[0][1]}: lengths are "
                         "numbers of samples, 0 or more")
    return lengths


def lengths_digest(lengths: Sequence[int]) -> str:
    """A short fingerprint of the shards' lengths: a checkpoint's stream must have the same."""
    return f"{zlib.crc32(','.join(map(str, lengths)).encode()):08x}"  # a checksum, not a seed


# --- the global order ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Segment:
    """Samples ``[start, stop)`` of shard ``shard`` in pass ``epoch``, read by virtual reader ``reader``."""

    epoch: int
    reader: int
    shard: int
    start: int
    stop: int


@dataclass
class _Pass:
    """One pass's readers: their shards in order and their cumulative lengths."""

    shards: list[list[int]]
    cum: list[list[int]]
    sizes: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.sizes = [c[-1] for c in self.cum]

    def before(self, p: int) -> list[int]:
        """How many of each reader's samples lie at positions ``< p`` of the round-robin order."""
        sizes = self.sizes
        lo, hi = 0, max(sizes)  # the round t: the largest with sum(min(size, t)) <= p
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sum(min(n, mid) for n in sizes) <= p:
                lo = mid
            else:
                hi = mid - 1
        t = lo
        left = p - sum(min(n, t) for n in sizes)  # readers active in round t that already gave their sample
        out = []
        for n in sizes:
            took = min(n, t)
            if n > t and left > 0:
                took, left = took + 1, left - 1
            out.append(took)
        return out


class ShardOrder:
    """The global order of a sharded stream whose shard lengths are known: step ``s``'s samples,
    and rank ``r``'s micro-batches of them, as segments of shards (pure arithmetic)."""

    def __init__(self, lengths: Sequence[int], readers: int, global_batch: int, tail: Tail = "drop",
                 shuffle: bool = False, seed: int = 0) -> None:
        self.lengths = list(lengths)
        self.readers, self.global_batch, self.tail = readers, global_batch, tail
        self.shuffle, self.seed = shuffle, seed
        self.total = sum(self.lengths)
        if self.total == 0:
            raise ValueError(f"the stream's {len(self.lengths)} shards hold no sample")
        if tail == "drop" and self.total < global_batch:
            raise ValueError(f"the stream holds {self.total} samples, fewer than one global batch of {global_batch}: "
                             "lower the global batch, use more data, or ShardedStream(tail='next')")
        self._passes: dict[int, _Pass] = {}

    @property
    def steps_per_pass(self) -> int | None:
        """Steps of one pass with ``tail="drop"``; None with ``"next"`` (they vary by pass)."""
        return self.total // self.global_batch if self.tail == "drop" else None

    @property
    def dropped(self) -> int:
        """Samples of each pass that no step takes (``tail="drop"``)."""
        return self.total % self.global_batch if self.tail == "drop" else 0

    def pass_order(self, epoch: int) -> _Pass:
        if epoch not in self._passes:
            k = len(self.lengths)
            order = list(range(k))
            if self.shuffle:
                g = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
                order = torch.randperm(k, generator=g).tolist()
            shards = [order[v::self.readers] for v in range(self.readers)]
            cum = [[0] for _ in shards]
            for v, own in enumerate(shards):
                for s in own:
                    cum[v].append(cum[v][-1] + self.lengths[s])
            if len(self._passes) > 4:
                self._passes.clear()
            self._passes[epoch] = _Pass(shards, cum)
        return self._passes[epoch]

    def epoch_of_step(self, step: int) -> int:
        """The pass a step belongs to: the one its last sample lies in (``"next"``: a step that opens
        with the last samples of a pass belongs to the next)."""
        if self.tail == "drop":
            return step // (self.total // self.global_batch)
        return ((step + 1) * self.global_batch - 1) // self.total

    def first_step(self, epoch: int) -> int:
        """The first step of pass ``epoch``."""
        if self.tail == "drop":
            return epoch * (self.total // self.global_batch)
        # the first step whose last position lies in this pass
        return max(0, -(-(epoch * self.total + 1) // self.global_batch) - 1)

    def _pieces(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """Positions ``[lo, hi)`` of the endless order as (pass, start, stop) within passes."""
        while lo < hi:
            e, a = divmod(lo, self.total)
            b = min(self.total, a + hi - lo)
            yield e, a, b
            lo += b - a

    def step_runs(self, step: int) -> list[tuple[int, int, int, int]]:
        """Step ``step``'s samples as (pass, reader, first, stop) runs of reader samples, in the
        order ranks take them: by pass, then reader."""
        B = self.global_batch
        if self.tail == "drop":
            per = self.total // B
            e, within = divmod(step, per)
            pieces = [(e, within * B, (within + 1) * B)]
        else:
            pieces = list(self._pieces(step * B, (step + 1) * B))
        runs = []
        for e, a, b in pieces:
            order = self.pass_order(e)
            first, stop = order.before(a), order.before(b)
            runs += [(e, v, first[v], stop[v]) for v in range(self.readers) if stop[v] > first[v]]
        return runs

    def segments(self, runs: list[tuple[int, int, int, int]], lo: int, hi: int) -> list[Segment]:
        """Samples ``[lo, hi)`` of a step (its runs laid end to end) as shard segments."""
        out, at = [], 0
        for e, v, first, stop in runs:
            n = stop - first
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                out += self._reader_segments(e, v, first + a - at, first + b - at)
            at += n
            if at >= hi:
                break
        return out

    def _reader_segments(self, epoch: int, v: int, j0: int, j1: int) -> list[Segment]:
        order = self.pass_order(epoch)
        cum, shards = order.cum[v], order.shards[v]
        out = []
        i = bisect.bisect_right(cum, j0) - 1
        while j0 < j1:
            while cum[i + 1] <= j0:  # empty shards
                i += 1
            stop = min(j1, cum[i + 1])
            out.append(Segment(epoch, v, shards[i], j0 - cum[i], stop - cum[i]))
            j0 = stop
        return out

    def micro_batches(self, step: int, rank: int, world: int, accumulation: int) -> list[list[Segment]]:
        """Rank ``rank``'s micro-batches of step ``step``: its ``B/W`` of the step's samples, in ``A``
        equal parts."""
        B = self.global_batch
        share, m = B // world, B // (world * accumulation)
        runs = self.step_runs(step)
        base = rank * share
        return [self.segments(runs, base + a * m, base + (a + 1) * m) for a in range(accumulation)]


class ShardReader:
    """Reads segments of a :class:`ShardedStream` in one process: one open shard per virtual reader,
    read on from where it is; a shard is (re)opened at the segment's start (by ``seek`` where the
    stream has one, or by reading from the shard's start), or read past a gap of other ranks' (or
    workers') samples. Counts the samples read only to be dropped: :attr:`reread`."""

    SEEK_GAP = 256  # a gap this long is crossed by seeking, where the stream can

    def __init__(self, stream: ShardedStream) -> None:
        self.stream = stream
        self.open: dict[tuple[int, int], tuple[int, Iterator[Any], int]] = {}  # (pass, reader) -> shard, it, offset
        self.reread = 0  # samples read and dropped to reach a position
        self._epoch: int | None = None

    def take(self, seg: Segment) -> list[Any]:
        stream = self.stream
        if seg.epoch != self._epoch:
            set_epoch = getattr(stream, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(seg.epoch)
            self._epoch = seg.epoch
            self.open = {k: v for k, v in self.open.items() if k[0] >= seg.epoch}
        key = (seg.epoch, seg.reader)
        shard, it, at = self.open.get(key, (-1, iter(()), 0))
        gap = seg.start - at
        if shard != seg.shard or gap < 0 or (stream.seek is not None and gap >= self.SEEK_GAP):
            it, skipped = stream.open(seg.shard, seg.start)
            reached = skipped == seg.start or stream.seek is not None
        else:
            skipped = _skip(it, gap)
            reached = skipped == gap
        self.reread += skipped
        got = list(islice(it, seg.stop - seg.start)) if reached else []
        if len(got) < seg.stop - seg.start:
            raise ValueError(f"shard {seg.shard} ({stream.sources[seg.shard]!r}) ended before sample {seg.stop}, but "
                             f"its length is {stream_length(stream, seg.shard)}: the data changed since the lengths "
                             f"were taken; {_stale_hint(stream)}")
        self.open[key] = (seg.shard, it, seg.stop)
        return got


def stream_length(stream: ShardedStream, k: int) -> str:
    lengths = getattr(stream, "_resolved", None)
    return str(lengths[k]) if lengths is not None else "unknown"


def _stale_hint(stream: ShardedStream) -> str:
    where = cache_path(stream) if stream.lengths is None else None
    return f"delete {where} to count again" if where is not None else "give the shards' true lengths"
