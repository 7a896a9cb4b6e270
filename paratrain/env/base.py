"""What every cluster environment tells a process about its place in the job."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ProcessInfo", "global_rank", "env_int"]


@dataclass(frozen=True)
class ProcessInfo:
    """The position of this process in the job, as read from the launcher's environment.

    The usual arithmetic holds: ``world_size = nnodes * local_world_size`` and
    ``rank = node_rank * local_world_size + local_rank`` (for homogeneous nodes).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "single"  # which environment it came from: torchelastic, slurm, mpi, single

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size {self.world_size} from {self.source} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} from {self.source} is outside world size {self.world_size}"
            )
        if self.world_size > 1 and not 1 <= self.master_port <= 65535:
            raise ValueError(f"MASTER_PORT {self.master_port} (from {self.source}) is not a TCP port: use one in "
                             "1024-65535 that is free on rank 0's host, the same on every rank")

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def global_rank(node_rank: int, nproc_per_node: int, local_rank: int) -> int:
    """rank = node_rank × procs per node + local_rank."""
    return node_rank * nproc_per_node + local_rank


def env_int(name: str, default: int | None = None) -> int:
    """Read an integer environment variable, with a one-line error naming it when it is not one."""
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise KeyError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


class UnavailableError(RuntimeError):
    """A device or backend that was asked for is not on this machine (a one-line user error)."""


class CollectiveTimeoutError(RuntimeError):
    """A collective ran past ``timeout_s``: names the rank(s) that did not arrive, in one line."""

    speaker: int | None = None  # the one rank that prints the line (every rank that waited raises it)


class PeerLostError(CollectiveTimeoutError):
    """A collective failed because a peer closed its connection: that peer ended first (one line)."""
