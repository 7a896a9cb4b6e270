"""Seed 001's pattern: ``mp.spawn`` and the script's own ``init_process_group(rank=r, world_size=n)``,
with no launcher variables in the environment; then ``paratrain.Parallel``. Prints one JSON line
per rank: where paratrain thinks the process is, and the rows of one global batch it reads."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import TensorDataset


def main(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import paratrain

    pt = paratrain.Parallel(strategy="ddp", global_batch=8)
    loader = pt.train_loader(TensorDataset(torch.arange(16.0)), shuffle=False)
    first = next(iter(loader))[0].tolist()
    line = json.dumps({"rank": pt.rank, "world": pt.world_size, "main": pt.is_main_process,
                       "helper_rank": paratrain.rank(), "rows": first})
    os.write(1, (line + "\n").encode())  # one write: the two ranks' lines cannot interleave
    pt.close()


if __name__ == "__main__":
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
              "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        os.environ.pop(k, None)
    mp.spawn(main, args=(2, int(sys.argv[1])), nprocs=2)
