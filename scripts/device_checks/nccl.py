"""The device check: nccl at world size 1 (and the CPU twin over gloo)."""

from __future__ import annotations

import copy
import time

from .base import CheckFailed, Result, _batches, _device, _mlp, _plain_sgd, _state_rel, check
from .flight import flight_recorder


@check
def nccl(mode: str, budget: float) -> Result:
    """nccl at world size 1 (gloo on the CPU): the collectives paratrain uses, paratrain's
    ``all_gather``/``reduce``, and DDP on the group, against a plain loop."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.env.network import free_port
    from paratrain.env.devices import select_backend
    from paratrain.metrics import all_gather, reduce

    t0 = time.monotonic()
    device = _device(mode)
    backend = "nccl" if mode == "gpu" else "gloo"
    if mode == "gpu":
        if not dist.is_nccl_available():
            raise CheckFailed(f"torch {torch.__version__} has no nccl backend")
        if select_backend(device) != "nccl":
            raise CheckFailed(f"paratrain picks backend {select_backend(device)!r} for {device}, not nccl")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        x = torch.arange(1.0, 9.0, device=device)
        t = x.clone()
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        gathered = [torch.empty_like(t)]
        dist.all_gather(gathered, t)
        if mode == "gpu":  # gloo has neither of these
            flat = torch.empty_like(t)
            dist.all_gather_into_tensor(flat, t)
            rs = torch.empty_like(t)
            dist.reduce_scatter_tensor(rs, t)
            gathered += [flat, rs]
        dist.barrier()
        for got in (t, *gathered):
            if not torch.equal(got, x):
                raise CheckFailed(f"a {backend} collective at world size 1 changed its tensor: {got.tolist()}")
        if not torch.equal(all_gather(x), x) or float(reduce(x.sum(), "mean", device=device)) != float(x.sum()):
            raise CheckFailed("paratrain's all_gather/reduce at world size 1 changed the value")
        nccl_version = None
        if mode == "gpu":
            v = torch.cuda.nccl.version()
            nccl_version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)

        batches = _batches(8, 32, (64,))
        torch.manual_seed(1)
        ref = _mlp().to(device)
        ddp_model = DDP(copy.deepcopy(ref), device_ids=[0] if device.type == "cuda" else None)
        ref_losses = _plain_sgd(ref, batches, device)
        ddp_losses = _plain_sgd(ddp_model, batches, device)
        err, key = _state_rel(ddp_model.module.state_dict(), ref.state_dict())
        print(f"losses plain {ref_losses[-1]:.6f}, ddp {ddp_losses[-1]:.6f}; worst parameter {key}: {err:.2e}")
        if not err <= 1e-6:
            raise CheckFailed(f"DDP over {backend} at world size 1 drifts from the plain loop: {key} {err:.2e} > 1e-6")
    finally:
        dist.destroy_process_group()
    summary = f"{backend} at world size 1: collectives exact, DDP = plain loop after 8 steps (rel. {err:.1e})"
    flight: dict[str, object] = {}
    if mode == "gpu":  # the CPU twin of this part is a test of the suite (tests/scripts/test_device_check.py)
        flight = flight_recorder(mode, budget - (time.monotonic() - t0))
        summary += "; Flight Recorder dumped on a 3 s nccl timeout, doctor read it back"
    return Result(summary + (f"; NCCL {nccl_version}" if nccl_version else ""),
                  {"backend": backend, "nccl": nccl_version, "ddp_rel_err": err, "flight_recorder": flight})
