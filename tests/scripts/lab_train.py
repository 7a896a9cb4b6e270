"""Worker for the lab's multi-host tests: train :data:`PROBLEM` with ``Parallel(strategy="ddp")``;
rank 0 writes the final state and the job's facts (world size, gloo's interface) to ``OUT``.

Usage: ``paratrain run ... tests/scripts/lab_train.py OUT``. The test compares ``OUT`` with
``PROBLEM``'s one-process plain-PyTorch reference (``tests/parity.py``).
"""

import functools
import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import paratrain  # noqa: E402
from parity import Problem, mlp, teacher_data  # noqa: E402

# fsdp's parity problem (tests/strategies/test_fsdp.py) at a global batch that 2 and 3 hosts divide:
# float32 vs float64 and 1 vs 2 threads differ by 1.0e-7 (measured), so 1e-5 holds ~100x.
PROBLEM = Problem(functools.partial(mlp, 12, 16, 16, 4), functools.partial(teacher_data, 96, (12,), seed=7),
                  global_batch=48, steps=6, seed=5, lr=0.05, momentum=0.9, rtol=1e-5)


def tcp_local_addresses() -> set[str]:
    """Local IPv4 addresses of this process's established TCP connections (its store client and
    gloo's pairs), from ``/proc/net/tcp``."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addrs = set()
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            cols = line.split()
            if cols[3] == "01" and cols[9] in inodes:  # 01: ESTABLISHED
                ip = bytes.fromhex(cols[1].split(":")[0])[::-1]
                addrs.add(".".join(map(str, ip)))
    return addrs


def main(out: str) -> None:
    # LAB_STEPS: a longer run (the failure tests cut a link mid-run); rank 0 writes each finished
    # step to LAB_PROGRESS.
    p = PROBLEM.replace(steps=int(os.environ.get("LAB_STEPS", PROBLEM.steps)))
    progress = os.environ.get("LAB_PROGRESS")
    pt = paratrain.Parallel(strategy="ddp", global_batch=p.global_batch, seed=p.seed, backend="gloo",
                            accelerator="cpu", timeout_s=float(os.environ.get("LAB_TIMEOUT_S", 60)))
    model = p.model()
    opt = p.optimizer(model.parameters())
    model, opt = pt.setup(model, opt)
    loader = pt.train_loader(TensorDataset(*p.data()))
    while pt.global_step < p.steps:
        for xb, yb in loader:
            opt.zero_grad()
            pt.backward(nn.functional.cross_entropy(model(xb), yb))
            opt.step()
            if progress and pt.is_main_process and pt.micro_step == 0:
                with open(progress, "w") as f:
                    f.write(str(pt.global_step))
            if pt.global_step == p.steps and pt.micro_step == 0:
                break
    addresses = sorted(tcp_local_addresses())
    state = {k: v.detach().clone() for k, v in pt.unwrap(model).state_dict().items()}
    if pt.is_main_process:
        torch.save({"state": state, "world_size": pt.world_size,
                    "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
                    "master_addr": os.environ.get("MASTER_ADDR"), "tcp_local_addresses": addresses}, out)
    pt.close()


if __name__ == "__main__":
    main(sys.argv[1])
