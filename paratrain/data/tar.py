"""Tar shards (WebDataset's format) as a :class:`~paratrain.data.ShardedStream`: each ``.tar`` a shard,
each sample the files that share a key (``000123.jpg``, ``000123.cls`` → ``{"__key__": "000123",
"jpg": b"...", "cls": b"..."}``), read through ``webdataset``'s tar iterators
(``pip install 'paratrain[tar]'``).

An uncompressed tar seeks: its members' headers are read once (tarfile steps over their data), so a
shard's length is its count of keys and a resumed run opens the shard at its sample's first header,
reading no sample before it. A compressed one (gzip, bzip2, xz: told by its first bytes, not its name)
cannot seek: its length is counted once by reading it (``decode`` runs then too; the counts are cached
beside the shards) and a resume reads the shard from its start, skipping to its sample.
"""

from __future__ import annotations

import os
import re
import tarfile
from typing import Any, Callable, Iterator, Sequence

from .shards import ShardedStream, Tail

__all__ = ["tar_stream"]

COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")
"""The first bytes of gzip, bzip2 and xz files: tars that cannot seek (their members are reached by
decompressing from the start)."""
ZSTD = b"\x28\xb5\x2f\xfd"
META = re.compile(r"__[^/]*__($|/)")
"""Members webdataset's tar iterator skips (``__key__``-style metadata), which are no samples."""


def _webdataset() -> Any:
    try:
        import webdataset.tariterators as ti
    except ImportError:
        raise ImportError("tar shards are read through webdataset, which is not installed: "
                          "pip install 'paratrain[tar]' (or webdataset)") from None
    return ti


def _head(path: str | os.PathLike) -> bytes:
    with open(path, "rb") as f:
        return f.read(6)


def seekable(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an uncompressed tar, whose members can be reached by their offsets."""
    return not _head(path).startswith(COMPRESSED)


def _is_sample_file(member: tarfile.TarInfo) -> bool:
    """What webdataset's tar iterator yields: regular files that are not its metadata."""
    name = member.name
    if not member.isreg() or META.match(name):
        return False
    return not ("/" not in name and name.startswith("__") and name.endswith("__"))


class _TarReader:
    """``read``, ``seek`` and ``length`` of a tar stream (picklable: DataLoader workers open the files)."""

    def __init__(self, decode: Callable[[dict[str, Any]], Any] | None) -> None:
        self.decode = decode

    def starts(self, path: str | os.PathLike) -> list[int]:
        """The offset of each sample's first member header in an uncompressed tar (headers only)."""
        ti = _webdataset()
        out: list[int] = []
        last = None
        with tarfile.open(path, "r:") as tf:
            for member in tf:
                key = ti.base_plus_ext(member.name)[0] if _is_sample_file(member) else None
                if key is None or key == last:
                    continue
                out.append(member.offset)
                last = key
        return out

    def length(self, path: str | os.PathLike) -> int:
        if seekable(path):
            return len(self.starts(path))
        return sum(1 for _ in self._samples(path, 0))  # read, not decoded

    def read(self, path: str | os.PathLike) -> Iterator[Any]:
        return self.seek(path, 0)

    def seek(self, path: str | os.PathLike, offset: int) -> Iterator[Any]:
        for sample in self._samples(path, offset):
            yield self.decode(sample) if self.decode is not None else sample

    def _samples(self, path: str | os.PathLike, offset: int) -> Iterator[dict[str, Any]]:
        ti = _webdataset()
        skip = offset
        with open(path, "rb") as f:
            if offset and seekable(path):
                starts = self.starts(path)
                if offset >= len(starts):
                    return
                f.seek(starts[offset])  # a tar is a sequence of headers: read on from this sample's first
                skip = 0
            files = ({**sample, "__url__": os.fspath(path)} for sample in ti.tar_file_iterator(f))
            for sample in ti.group_by_keys(files):
                if skip:
                    skip -= 1
                    continue
                yield sample


def tar_stream(paths: Sequence[str | os.PathLike], decode: Callable[[dict[str, Any]], Any] | None = None, *,
               readers: int | None = None, tail: Tail = "drop", shuffle: bool = False, seed: int = 0,
               cache: str | os.PathLike | bool | None = None) -> ShardedStream:
    """Tar shards as a stream of samples: a :class:`~paratrain.data.ShardedStream` with one shard per
    file, each sample a dict of the files that share a key (their bytes by extension, with ``__key__``
    and ``__url__``), passed through ``decode`` when given (e.g. ``webdataset.autodecode.Decoder``,
    or a function that makes tensors). Uncompressed tars seek (lengths from their headers); compressed
    ones are counted once by reading (cached beside them, or in ``cache``) and resumed by reading.
    ``readers``, ``tail``, ``shuffle``, ``seed``: as for ``ShardedStream``."""
    _webdataset()  # the one-line error now, not in a worker
    if not paths:
        raise ValueError("tar_stream needs at least one file")
    sources = [os.fspath(p) for p in paths]
    for p in sources:
        if _head(p).startswith(ZSTD):
            raise ValueError(f"tar_stream: {p} is zstd-compressed, which Python's tarfile reads only from Python 3.14: "
                             "decompress it (zstd -d) or write .tar or .tar.gz shards")
    reader = _TarReader(decode)
    # plain tars: lengths from the headers, seek by header offset. With a compressed one among them the
    # stream counts by reading (once, its ranks sharing the shards; decode runs then too) and caches the
    # lengths beside the shards, and a resume reads each open shard from its start (and says so)
    every_seeks = all(seekable(p) for p in sources)
    return ShardedStream(sources, reader.read, lengths=reader.length if every_seeks else None,
                         seek=reader.seek if every_seeks else None, readers=readers, tail=tail, shuffle=shuffle,
                         seed=seed, cache=False if every_seeks else cache)
