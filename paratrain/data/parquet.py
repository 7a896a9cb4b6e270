"""Parquet files as a :class:`~paratrain.data.ShardedStream` that seeks: each file a shard, its length
from its footer (nothing is counted), a resumed run opened at its row through the row groups.

Read through ``pyarrow`` (``pip install 'paratrain[parquet]'``), a record batch at a time. A sample
is a row: a dict of column name to value, numbers and lists of numbers as tensors (so that the
DataLoader's collate stacks them), other values (strings) as they are.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import torch

from .shards import ShardedStream, Tail

__all__ = ["parquet_stream"]


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("Parquet files are read through pyarrow, which is not installed: "
                          "pip install 'paratrain[parquet]' (or pyarrow)") from None
    return pq


def _value(v: Any) -> Any:
    if isinstance(v, (bool, int, float)):
        return torch.tensor(v)
    if isinstance(v, list) and v and all(isinstance(x, (bool, int, float)) for x in v):
        return torch.tensor(v)
    return v


class _ParquetReader:
    """``read`` and ``seek`` of a parquet stream (picklable: DataLoader workers open the files themselves)."""

    def __init__(self, columns: Sequence[str] | None, batch_rows: int) -> None:
        self.columns, self.batch_rows = (list(columns) if columns is not None else None), batch_rows

    def length(self, path: str | os.PathLike) -> int:
        return int(_pyarrow().ParquetFile(path).metadata.num_rows)

    def read(self, path: str | os.PathLike) -> Iterator[dict[str, Any]]:
        return self.seek(path, 0)

    def seek(self, path: str | os.PathLike, offset: int) -> Iterator[dict[str, Any]]:
        f = _pyarrow().ParquetFile(path)
        meta, start, first = f.metadata, 0, 0
        while first < meta.num_row_groups and start + meta.row_group(first).num_rows <= offset:
            start += meta.row_group(first).num_rows  # whole row groups before the offset: not read
            first += 1
        skip = offset - start
        groups = list(range(first, meta.num_row_groups))
        if not groups:
            return
        for batch in f.iter_batches(batch_size=self.batch_rows, row_groups=groups, columns=self.columns):
            rows = batch.to_pylist()
            if skip >= len(rows):
                skip -= len(rows)
                continue
            for row in rows[skip:]:
                yield {k: _value(v) for k, v in row.items()}
            skip = 0


def parquet_stream(paths: Sequence[str | os.PathLike], columns: Sequence[str] | None = None, *,
                   readers: int | None = None, tail: Tail = "drop", shuffle: bool = False, seed: int = 0,
                   batch_rows: int = 1024) -> ShardedStream:
    """Parquet files as a stream of rows that seeks: a :class:`~paratrain.data.ShardedStream` with one
    shard per file, its lengths read from the files' footers, and ``seek`` through the row groups
    (a resume reads from the row group that holds its row). ``columns``: those to read (all by
    default); ``readers``, ``tail``, ``shuffle``, ``seed``: as for ``ShardedStream``."""
    _pyarrow()  # the one-line error now, not in a worker
    if not paths:
        raise ValueError("parquet_stream needs at least one file")
    reader = _ParquetReader(columns, batch_rows)
    return ShardedStream([os.fspath(p) for p in paths], reader.read, lengths=reader.length, seek=reader.seek,
                         readers=readers, tail=tail, shuffle=shuffle, seed=seed, cache=False)
