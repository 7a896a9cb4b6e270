"""paratrain: take a PyTorch training job from one device to N workers without changing its result."""

from .launch.forkserver import start_early as _start_early

_start_early()  # `paratrain train --nproc-per-node N`: the workers' forkserver imports torch while we do

from .env import (
    barrier,
    destroy,
    init,
    is_main_process,
    local_rank,
    main_process_first,
    print_once,
    rank,
    save_on_main,
    seed_everything,
    world_size,
)
from .config import DataConfig, OptimConfig, ParallelConfig, TrainConfig
from .launch.spawn import launch
from .parallel import Parallel, ParallelOptimizer, ParallelScheduler
from .threads import configure_threads, fork, fork_map, wait

from ._version import __version__ as __version__

__all__ = [
    "Parallel", "ParallelOptimizer", "ParallelScheduler", "ParallelConfig", "TrainConfig", "DataConfig", "OptimConfig",
    "launch", "init", "destroy", "barrier", "rank", "world_size", "local_rank",
    "is_main_process", "print_once", "save_on_main", "main_process_first", "seed_everything",
    "fork", "wait", "fork_map", "configure_threads",
]
