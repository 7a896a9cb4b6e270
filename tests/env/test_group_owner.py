"""Whose process group it is (issue 26, item 7): ``Parallel.close`` (``env.process.destroy``) ends
only the group paratrain created; one the script (or Ray Train) made before ``Parallel`` stays for
its owner. Real processes over gloo (``fastlaunch``: forked from a server that imported torch)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import fastlaunch

pytestmark = pytest.mark.timeout(180)


def _step(pt):
    net = torch.nn.Linear(2, 1)
    model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


def _closes_around_the_scripts_own_group(local_rank):
    import torch.distributed as dist

    import paratrain

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # the script's own, before Parallel
    pt = paratrain.Parallel(strategy="ddp", global_batch=2)
    _step(pt)
    pt.close()
    kept = dist.is_initialized()
    total = torch.tensor(float(dist.get_rank() + 1))
    dist.all_reduce(total)  # the group still works
    dist.destroy_process_group()  # its owner ends it
    return kept, total.item(), dist.is_initialized()


def test_close_leaves_a_group_the_script_made_to_the_script():
    assert fastlaunch.launch(_closes_around_the_scripts_own_group, 2, timeout=120) == [(True, 3.0, False)] * 2


def _closes_its_own_group(local_rank):
    import torch.distributed as dist

    import paratrain

    pt = paratrain.Parallel(strategy="ddp", global_batch=2)
    _step(pt)
    pt.close()
    return dist.is_initialized()


def test_close_ends_the_group_paratrain_made():
    assert fastlaunch.launch(_closes_its_own_group, 2, timeout=120) == [False, False]
