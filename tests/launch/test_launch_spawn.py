import pytest
import torch
import torch.distributed as dist

import paratrain
from paratrain.launch.spawn import LaunchError


def _sum_ranks(local_rank, scale):
    d = paratrain.init()
    t = torch.tensor([float(d.rank)])
    dist.all_reduce(t)
    paratrain.destroy()
    return (d.rank, d.world_size, d.backend, t.item() * scale)


def test_launch_returns_results_in_rank_order():
    out = paratrain.launch(_sum_ranks, nprocs=2, args=(10,), timeout=60)
    assert out == [(0, 2, "gloo", 10.0), (1, 2, "gloo", 10.0)]


def _fail_on_rank_1(local_rank):
    d = paratrain.init(timeout_s=20)
    if d.rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever without the launcher's cleanup


def test_failure_names_rank_and_does_not_hang():
    with pytest.raises(LaunchError, match=r"rank 1 failed: ValueError: boom on purpose"):
        paratrain.launch(_fail_on_rank_1, nprocs=2, timeout=60)


def _hang(local_rank):
    import time
    time.sleep(600)


def test_timeout_kills_workers():
    with pytest.raises(LaunchError, match="timed out"):
        paratrain.launch(_hang, nprocs=2, timeout=3)
