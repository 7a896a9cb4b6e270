"""paratrain layers that behave the same on one device and across N workers."""

from .syncbn import SyncBatchNorm, convert_sync_batchnorm, has_unsynced_batchnorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "has_unsynced_batchnorm"]
