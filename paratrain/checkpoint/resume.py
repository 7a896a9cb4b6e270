"""Resuming a run: which checkpoint, whether it belongs to this run, and loading it.

The one owner of "resume": ``paratrain train``'s loop makes one call (:func:`resume`), as
torchtitan's trainer calls ``checkpointer.load(step=...)``; ``Parallel.load_checkpoint`` and
``Parallel.load_state_dict`` use the same checks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_continues"]


def check_continues(state: dict[str, Any], global_batch: int, seed: int) -> None:
    """Refuse, in one line, a run ``state`` (``Run.state_dict()`` of a checkpoint) that a run with
    ``global_batch`` and ``seed`` cannot continue: the data position is a step of global batches
    in the epoch order of the seed. The world size may differ."""
    if state["global_batch"] != global_batch:
        raise ValueError(f"was written with global batch {state['global_batch']}, this run uses "
                         f"{global_batch}: resume with the same global batch (the world size may change)")
    if state.get("seed") is not None and int(state["seed"]) != seed:  # the epoch's order is the seed's
        raise ValueError(f"was written with seed {state['seed']}, this run uses {seed}: resume with "
                         "the same seed (the rest of the epoch would repeat some samples and skip others)")
