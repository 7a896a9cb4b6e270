"""Checkpoints: atomic files with SHA-256 manifests, loading that never runs pickled code, exact
resume (also on another world size)."""

from .io import (CheckpointError, list_checkpoints, load_file, load_latest, save_file, verify_checkpoint,
                 write_checkpoint)
from .asynchronous import finish_checkpoints, wait_for_checkpoint
from .export import export_checkpoint, load_model, load_weights, save_model, save_pretrained
from .resume import check_continues, resume
from .state import has_checkpoint, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError", "save_file", "load_file", "write_checkpoint", "load_latest", "list_checkpoints",
    "verify_checkpoint", "save_checkpoint", "load_checkpoint", "has_checkpoint", "export_checkpoint", "save_model",
    "load_model", "save_pretrained", "check_continues", "resume", "wait_for_checkpoint", "finish_checkpoints",
    "load_weights",
]
