"""Data: global-batch sampling, device loaders, streams, token files, built-in datasets and batched augmentation."""

from .batch import batch_size, map_tensors, to_device
from .loaders import EvalLoader, GlobalBatchLoader
from .stream import ShardedStream, StreamLoader
from .tokens import TokenWindows, document_mask
from .parquet import parquet_stream
from .tar import tar_stream
from .sampler import BatchPlan, GlobalBatchSampler, ShardedEvalSampler, epoch_permutation

__all__ = [
    "BatchPlan", "GlobalBatchSampler", "ShardedEvalSampler", "epoch_permutation",
    "GlobalBatchLoader", "EvalLoader", "to_device", "map_tensors", "batch_size", "ShardedStream", "StreamLoader",
    "TokenWindows", "document_mask", "parquet_stream", "tar_stream",
]
