"""Worker for ``paratrain run``: all-reduce the ranks, train a tiny DDP model, rank 0 writes JSON.

Usage: ``paratrain run --nproc-per-node 2 tests/scripts/allreduce.py OUT_DIR``.
"""

import gc
import json
import os
import sys

import torch
import torch._dynamo  # noqa: F401  (see the note in main)
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import paratrain


def train_ddp(rank: int) -> list[float]:
    """Three SGD steps of a DDP linear model on rank-specific data; returns the final parameters."""
    paratrain.seed_everything(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank sees different data
    for _ in range(3):
        x = torch.randn(8, 4, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def main(out_dir: str) -> None:
    d = paratrain.init(backend="gloo", timeout_s=60, accelerator="cpu")
    total = torch.tensor([float(d.rank)])
    dist.all_reduce(total)
    info = d.info
    me = {"rank": d.rank, "local_rank": info.local_rank, "node_rank": info.node_rank,
          "local_world_size": info.local_world_size, "pid": os.getpid()}
    everyone: list = [None] * d.world_size
    dist.all_gather_object(everyone, me)
    params: list = [None] * d.world_size
    dist.all_gather_object(params, train_ddp(d.rank))

    if d.is_main_process:
        result = {"world_size": d.world_size, "sum": total.item(), "ranks": everyone,
                  "params_equal": all(p == params[0] for p in params),
                  "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
    # torch 2.13: importing torch._dynamo after init_process_group (DDP does, on construction)
    # keeps the process group alive past destroy(); its gloo threads then drop Python tensors
    # while the interpreter finalizes and the worker aborts ("terminate called without an active
    # exception", SIGABRT) now and then. Importing dynamo first and freeing the DDP model before
    # destroy() lets destroy() stop those threads.
    gc.collect()
    paratrain.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
