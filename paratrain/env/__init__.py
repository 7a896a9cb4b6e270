"""Process setup: where this process sits in the job, and the ``torch.distributed`` group."""

from .base import ProcessInfo, global_rank
from .detect import detect_process
from .process import (
    Dist,
    barrier,
    destroy,
    init,
    is_main_process,
    local_rank,
    main_process_first,
    print_once,
    rank,
    save_on_main,
    world_size,
)
from .seeding import seed_everything

__all__ = [
    "ProcessInfo", "global_rank", "detect_process", "Dist", "init", "destroy", "barrier",
    "is_main_process", "rank", "world_size", "local_rank", "print_once", "save_on_main",
    "main_process_first", "seed_everything",
]
