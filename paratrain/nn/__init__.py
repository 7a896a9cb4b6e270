"""paratrain layers that behave the same on one device and across N workers."""

from .checkpointing import apply_activation_checkpointing
from .syncbn import SyncBatchNorm, convert_sync_batchnorm, has_unsynced_batchnorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "has_unsynced_batchnorm", "apply_activation_checkpointing"]
