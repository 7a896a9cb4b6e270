"""Checkpoints: atomic files, ``weights_only`` loading, exact resume (also on another world size)."""

from .io import CheckpointError, list_checkpoints, load_file, load_latest, save_file, write_checkpoint
from .state import has_checkpoint, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError", "save_file", "load_file", "write_checkpoint", "load_latest", "list_checkpoints",
    "save_checkpoint", "load_checkpoint", "has_checkpoint",
]
