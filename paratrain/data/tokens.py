"""Token files as a map-style data set: nanoGPT's ``train.bin`` (a flat array of token ids), memory-mapped.

A token file is read as fixed-length windows: sample ``i`` is ``(x, y)``, ``block_size`` tokens and
the same shifted by one (the next-token targets), int64. Being map-style, every guarantee of the
global-batch sampler holds (the same steps at any world size, resume by the global step, nothing
re-read). ``windows="contiguous"``: a file of ``n`` tokens gives ``(n - 1) // block_size`` windows
that tile it; ``windows="random"``: as many windows, each at a random offset drawn from ``(seed,
epoch, index)`` (nanoGPT's ``get_batch``, made reproducible: the same at every world size and
after a resume; an epoch's offsets are drawn at once, 8 bytes a window). Several files are one data set; no window crosses a file's end.

A micro-batch is read with one gather per file (``reads_batches``: paratrain's loaders index it
with the micro-batch's index list), not one ``__getitem__`` per sample: the same cost as nanoGPT's
own reads from ``np.memmap``.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ..env.seeding import mix_seed

__all__ = ["TokenWindows", "token_vocab", "document_mask"]

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}


class TokenWindows(Dataset):
    """Windows of ``block_size`` tokens from one or more token files (``dtype``: ``uint16``, as
    nanoGPT writes them, ``uint32`` for vocabularies over 65,536, ``int32`` or ``int64``).

    ``eos``: the end-of-text token id (GPT-2's 50256) of files that pack documents one after another, as
    nanoGPT's do: each sample gets a third tensor, the document of each position (0, 1, ... from the
    window's start; the token after an ``eos`` starts the next), from which :func:`document_mask`
    makes an attention mask that keeps each document to itself. Windows do not depend on it: the
    packing is the file's, so the same at every world size and after a resume.

    ``dataset[i]`` is ``(x, y)``; ``dataset[[i, j, ...]]`` is a batch ``[x, y]`` of shape
    ``(len, block_size)``, read at once (a list with an ``epoch`` attribute, as paratrain's sampler
    gives, draws that epoch's random offsets). Files are opened lazily in each process (a
    DataLoader worker maps its own).
    """

    reads_batches = True  # paratrain's loaders hand it whole micro-batches of indices

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], block_size: int,
                 dtype: str = "uint16", windows: Literal["contiguous", "random"] = "contiguous", seed: int = 0,
                 eos: int | None = None) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"token dtype {dtype!r}: use one of {', '.join(_DTYPES)}")
        if windows not in ("contiguous", "random"):
            raise ValueError(f"windows={windows!r}: use 'contiguous' (windows that tile each file) or 'random' "
                             "(offsets drawn from the seed, the epoch and the index)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be at least 1")
        self.paths = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
        if not self.paths:
            raise ValueError("TokenWindows needs at least one token file")
        self.block_size, self.dtype, self.windows, self.seed, self.eos = block_size, dtype, windows, seed, eos
        item = np.dtype(_DTYPES[dtype]).itemsize
        self.tokens = []
        for p in self.paths:
            if not p.is_file():
                raise FileNotFoundError(f"token file {str(p)!r} does not exist: write it first (e.g. nanoGPT's "
                                        "data/*/prepare.py) or fix the path")
            size = p.stat().st_size
            if size % item:
                raise ValueError(f"token file {str(p)!r} has {size} bytes, not a whole number of {dtype} tokens "
                                 f"({item} bytes each): is dtype right?")
            if size // item < block_size + 1:
                raise ValueError(f"token file {str(p)!r} holds {size // item} tokens, fewer than one window of "
                                 f"{block_size} + 1: use a shorter block_size or a longer file")
            self.tokens.append(size // item)
        counts = [(n - 1) // block_size for n in self.tokens]
        self.starts = np.cumsum([0] + counts)  # file f's windows are indices [starts[f], starts[f+1])
        self._maps: list[np.ndarray] | None = None
        self._span = np.arange(block_size + 1)
        self._sizes = np.asarray(self.tokens, dtype=np.uint64)
        self._table: tuple[int, np.ndarray] | None = None  # (epoch, its random offsets of every window)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None, "_table": None}  # a worker (or a pickled copy) maps the files itself

    def _files(self) -> list[np.ndarray]:
        if self._maps is None:
            # plain arrays over the mapped files: indexing them skips np.memmap's Python-level wrapping
            self._maps = [np.asarray(np.memmap(p, dtype=_DTYPES[self.dtype], mode="r")) for p in self.paths]
            self._span = np.arange(self.block_size + 1)
        return self._maps

    def offsets(self, indices: np.ndarray, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Each index's file and first token."""
        if len(self.tokens) == 1:
            files = np.zeros(len(indices), dtype=np.int64)
        else:
            files = np.searchsorted(self.starts, indices, side="right") - 1
        if self.windows == "contiguous":
            return files, (indices - self.starts[files]) * self.block_size
        if self._table is None or self._table[0] != epoch:  # the epoch's offsets at once (10 ms a million windows)
            every = np.arange(len(self))
            high = self._sizes[self._file_of(every)].astype(np.int64) - self.block_size  # offsets 0..n-T-1
            rng = np.random.Generator(np.random.PCG64(mix_seed(self.seed, epoch)))
            self._table = (epoch, rng.integers(0, high, dtype=np.int64))
        return files, self._table[1][indices]

    def _file_of(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, indices, side="right") - 1

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.dim() == 0):
            return tuple(t[0] for t in self[[int(index)]])
        rows = np.asarray(index.tolist() if isinstance(index, torch.Tensor) else index, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"window index out of range 0..{len(self) - 1}")
        return self.read_batch(rows, int(getattr(index, "epoch", 0)))

    def read_batch(self, rows: np.ndarray, epoch: int = 0) -> list[torch.Tensor]:
        """Windows ``rows`` (valid indices, int64) of ``epoch`` as a batch ``[x, y]``: what paratrain's
        loader calls with each micro-batch's rows."""
        files, starts = self.offsets(rows, epoch)
        maps, n = self._files(), self.block_size + 1
        if self.block_size >= 32:  # a slice copy a window, into the int64 batch: half the time of a gather
            out = np.empty((len(rows), n), dtype=np.int64)
            for i, (f, o) in enumerate(zip(files.tolist(), starts.tolist())):
                out[i] = maps[f][o:o + n]
        elif len(maps) == 1:  # short windows: one gather
            out = maps[0][starts[:, None] + self._span].astype(np.int64)
        else:
            out = np.empty((len(rows), n), dtype=np.int64)
            for f in np.unique(files):
                mine = files == f
                out[mine] = maps[f][starts[mine, None] + self._span]  # one gather per file
        t = torch.from_numpy(out)
        x, y = t[:, :-1], t[:, 1:]
        if self.eos is None:
            return [x, y]  # what default_collate makes of (x, y) samples: a list
        ends = x == self.eos  # a document ends with its end-of-text token; the next token starts the next
        return [x, y, torch.cumsum(ends, dim=1) - ends.long()]


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed windows: causal, and within a document only. ``documents`` is
    ``(batch, T)`` (a :class:`TokenWindows` batch's third tensor, given ``eos``); the mask is
    ``(batch, 1, T, T)`` booleans, True where attention is allowed, as
    ``torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)`` takes it."""
    T = documents.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, :, None] == documents[:, None, :]).logical_and(causal).unsqueeze(1)


def token_vocab(paths: str | os.PathLike | Sequence[str | os.PathLike], dtype: str = "uint16") -> int:
    """The vocabulary a model needs for these token files: nanoGPT's ``meta.pkl`` beside the first
    (its ``vocab_size``), else the largest token id + 1 (read once, in chunks)."""
    files = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    meta = files[0].parent / "meta.pkl"
    if meta.is_file():
        with open(meta, "rb") as f:
            vocab = _PlainUnpickler(f).load().get("vocab_size")
        if isinstance(vocab, int) and vocab > 0:
            return vocab
    top = 0
    for p in files:
        data = np.memmap(p, dtype=_DTYPES[dtype], mode="r")
        for i in range(0, len(data), 1 << 24):
            top = max(top, int(data[i:i + (1 << 24)].max()))
    return top + 1


class _PlainUnpickler(pickle.Unpickler):
    """meta.pkl holds plain data (dicts of str and int): nothing else is built from it."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"meta.pkl refers to {module}.{name}: only plain data is read")
