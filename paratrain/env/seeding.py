"""The run's seeds: ``mix_seed``, the one formula every derived seed comes from, and
``seed_everything``, which seeds Python, NumPy and torch in a process."""

from __future__ import annotations

import random

import numpy as np
import torch

from .process import rank

__all__ = ["SEED_STRIDE", "mix_seed", "seed_everything"]


SEED_STRIDE = 1_000_003  # a prime larger than any epoch, step or rank count a run reaches


def mix_seed(seed: int, *values: int, bits: int = 64) -> int:
    """The one way paratrain derives a seed from the run's ``seed`` and positions (epoch, sample
    index, step, micro-step, rank): ``seed * 1_000_003 + value``, folded over ``values``, modulo
    ``2**bits`` (63: a non-negative int64, what ``torch.manual_seed`` and NumPy take).

    Every derived seed is one of these: the epoch order (``mix_seed(seed, epoch)``, the formula of
    the first release, so a seed keeps its data order), the synthetic data's noise, each sample's
    and each step's augmentation draws, and the random streams of a rank that joins a resumed run.
    Distinct positions give distinct seeds below ``1_000_003`` steps of each; generators seeded
    with nearby seeds draw unrelated streams (torch's and NumPy's Mersenne Twister, Python's)."""
    x = int(seed)
    for v in values:
        x = x * SEED_STRIDE + int(v)
    return x % 2**bits


def seed_everything(seed: int, offset_by_rank: bool = False) -> int:
    """Seed python, numpy and torch. With ``offset_by_rank`` each rank gets ``seed + rank``
    (different augmentation/dropout streams per rank); returns the seed used."""
    used = seed + (rank() if offset_by_rank else 0)
    random.seed(used)
    np.random.seed(used % 2**32)
    torch.manual_seed(used)
    return used
