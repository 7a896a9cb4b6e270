"""Batched, world-size-invariant data augmentation that runs on the batch's own device.

Instead of per-sample PIL transforms in data-loader workers, :class:`BatchAugment` augments a
whole ``(N, C, H, W)`` tensor at once (random crop with zero padding, horizontal flip,
per-channel normalisation). Its random parameters come from a CPU ``torch.Generator`` seeded with
``seed`` and drawn for ``total`` samples; a call uses rows ``[offset, offset + len(x))`` of those
draws. A global batch split across ranks (each rank passing its ``offset`` and the global
``total``) is therefore augmented exactly as if it had been processed whole on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .datasets import CIFAR10_MEAN, CIFAR10_STD

__all__ = ["BatchAugment", "augment_for", "eval_augment_for"]


@dataclass
class BatchAugment:
    """Random crop (zero padding ``crop_padding``), random horizontal flip, then normalisation.

    ``mean``/``std`` are per-channel; leave them ``None`` to skip normalisation. The draws for
    sample ``i`` of the global batch are the same whatever ``crop_padding``/``flip`` are set to, and
    depend only on ``seed``, ``total`` and ``i``.
    """

    crop_padding: int = 4
    flip: bool = True
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.crop_padding < 0:
            raise ValueError(f"crop_padding={self.crop_padding} must be >= 0")
        if (self.mean is None) != (self.std is None):
            raise ValueError(f"give both mean and std or neither (mean={self.mean}, std={self.std})")
        if self.mean is not None and self.std is not None:
            if len(self.mean) != len(self.std):
                raise ValueError(
                    f"mean {self.mean} and std {self.std} must have one value per channel each"
                )
            if any(s <= 0 for s in self.std):
                raise ValueError(f"std {self.std} must be positive in every channel")

    def draws(self, seed: int, total: int) -> tuple[Tensor, Tensor, Tensor]:
        """The CPU draws for ``total`` samples: crop row offsets, crop column offsets, flip flags."""
        gen = torch.Generator().manual_seed(int(seed))
        span = 2 * self.crop_padding + 1
        offsets = torch.randint(0, span, (total, 2), generator=gen)
        flips = torch.rand(total, generator=gen) < 0.5
        return offsets[:, 0], offsets[:, 1], flips

    def __call__(self, x: Tensor, seed: int, offset: int = 0, total: int | None = None) -> Tensor:
        """Augment ``x`` (``(N, C, H, W)``) as rows ``[offset, offset+N)`` of a batch of ``total``."""
        if x.dim() != 4:
            raise ValueError(f"BatchAugment expects a (N, C, H, W) batch, got shape {tuple(x.shape)}")
        n, c, h, w = x.shape
        total = n if total is None else int(total)
        if offset < 0 or offset + n > total:
            raise ValueError(
                f"rows [{offset}, {offset + n}) do not fit in a global batch of total={total}: "
                "pass this shard's start row and the global batch size"
            )
        if self.crop_padding > 0 or self.flip:
            dy, dx, flips = self.draws(seed, total)
            dy, dx, flips = (t[offset : offset + n].to(x.device) for t in (dy, dx, flips))
            x = self._crop_flip(x, dy, dx, flips)
        if self.mean is not None and self.std is not None:
            if len(self.mean) != c:
                raise ValueError(
                    f"mean/std have {len(self.mean)} channels but the batch has {c}: "
                    "give one value per channel"
                )
            mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, c, 1, 1)
            std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, c, 1, 1)
            x = (x - mean) / std
        return x

    def _crop_flip(self, x: Tensor, dy: Tensor, dx: Tensor, flips: Tensor) -> Tensor:
        """Vectorised zero-padded crop and flip: one ``gather`` of each output pixel from the padded
        image, by a per-sample flat index (about 6x faster on the CPU than 4-D advanced indexing,
        and the same values)."""
        n, c, h, w = x.shape
        p = self.crop_padding
        if p > 0:
            x = torch.nn.functional.pad(x, (p, p, p, p))
        else:
            dy = torch.zeros_like(dy)
            dx = torch.zeros_like(dx)
        rows = dy[:, None] + torch.arange(h, device=x.device)[None, :]  # (N, H)
        cols = dx[:, None] + torch.arange(w, device=x.device)[None, :]  # (N, W)
        if self.flip:
            cols = torch.where(flips[:, None], cols.flip(1), cols)
        wp = w + 2 * p
        flat = (rows[:, :, None] * wp + cols[:, None, :]).view(n, 1, h * w).expand(n, c, h * w)
        return torch.gather(x.reshape(n, c, -1), 2, flat).view(n, c, h, w)


def augment_for(dataset_name: str) -> BatchAugment | None:
    """The default training augmentation for a dataset name (``None`` means none).

    ``cifar10``: crop 4 + flip + CIFAR-10 normalisation; ``synthetic``: crop 4 + flip;
    ``digits`` and anything else: ``None``.
    """
    if dataset_name in ("cifar10", "torchvision:CIFAR10"):
        return BatchAugment(crop_padding=4, flip=True, mean=CIFAR10_MEAN, std=CIFAR10_STD)
    if dataset_name == "synthetic":
        return BatchAugment(crop_padding=4, flip=True)
    return None


def eval_augment_for(dataset_name: str) -> BatchAugment | None:
    """The evaluation-time transform for a dataset name: the same normalisation, no randomness.

    ``cifar10`` (and ``torchvision:CIFAR10``): normalisation only; everything else: ``None``.
    """
    train_aug = augment_for(dataset_name)
    if train_aug is None or train_aug.mean is None:
        return None
    return BatchAugment(crop_padding=0, flip=False, mean=train_aug.mean, std=train_aug.std)
