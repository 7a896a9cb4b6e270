"""Data: global-batch sampling, device loaders, built-in datasets and batched augmentation."""

from .loaders import EvalLoader, GlobalBatchLoader, to_device
from .sampler import BatchPlan, GlobalBatchSampler, ShardedEvalSampler, epoch_permutation

__all__ = [
    "BatchPlan", "GlobalBatchSampler", "ShardedEvalSampler", "epoch_permutation",
    "GlobalBatchLoader", "EvalLoader", "to_device",
]
