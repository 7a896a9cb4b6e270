"""torchrun / TorchElastic (and ``paratrain.launch``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``..."""

from __future__ import annotations

import os

from .base import ProcessInfo, env_int


def detect() -> ProcessInfo | None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = env_int("WORLD_SIZE")
    local_world = env_int("LOCAL_WORLD_SIZE", world)
    rank = env_int("RANK")
    return ProcessInfo(
        rank=rank,
        world_size=world,
        local_rank=env_int("LOCAL_RANK", rank % max(1, local_world)),
        local_world_size=local_world,
        node_rank=env_int("GROUP_RANK", rank // max(1, local_world)),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=env_int("MASTER_PORT", 29500),
        source="torchelastic" if "TORCHELASTIC_RUN_ID" in os.environ else "env",
    )
