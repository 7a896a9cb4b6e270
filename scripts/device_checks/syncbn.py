"""The device check: SyncBatchNorm over ddp x2."""

from __future__ import annotations

import copy
from typing import Any

from .base import CheckFailed, Result, _batches, _bn_cnn, _device, _plain_sgd, _state_rel, check


def _syncbn_worker(rank: int, mode: str, batches: list[Any], init: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import paratrain

    pt = paratrain.Parallel(strategy="ddp", sync_batchnorm=True, backend="gloo", global_batch=len(batches[0][0]),
                            accelerator="cuda" if mode == "gpu" else "cpu")
    model = _bn_cnn()
    model.load_state_dict(init)
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    kinds = sorted({f"{type(m).__module__}.{type(m).__name__}" for m in pt.unwrap(model).modules()
                    if "BatchNorm" in type(m).__name__})
    share = len(batches[0][0]) // pt.world_size
    for x, y in batches:  # this rank's contiguous share of each global batch
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        opt.zero_grad()
        pt.backward(F.cross_entropy(model(x.to(pt.device)), y.to(pt.device)))
        opt.step()
    state = {k: v.detach().cpu() for k, v in pt.unwrap(model).state_dict().items()}
    out = {"kinds": kinds, "device": str(pt.device), "backend": pt.dist.backend, "state": state}
    pt.close()
    return out


@check
def syncbn(mode: str, budget: float) -> Result:
    """``sync_batchnorm=True`` under ddp at world size 2 (both ranks on GPU 0, over gloo, which takes
    CUDA tensors): the layers become ``torch.nn.SyncBatchNorm`` (paratrain's own on the CPU), and 5
    steps equal one process with plain BatchNorm over the whole batch (parameters and running stats)."""
    import torch

    import paratrain

    device = _device(mode)
    batches = _batches(5, 16, (3, 8, 8))
    torch.manual_seed(1)
    ref = _bn_cnn()
    init = copy.deepcopy(ref.state_dict())
    ref = ref.to(device)
    _plain_sgd(ref, batches, device)
    # forked from a server that imported paratrain (and torch) once, not a new interpreter per rank
    results = paratrain.launch(_syncbn_worker, nprocs=2, args=(mode, batches, init), timeout=max(30.0, budget - 20),
                               env={"OMP_NUM_THREADS": "1"}, start_method="forkserver", preload=["paratrain"])
    want_kind = "torch.nn.modules.batchnorm.SyncBatchNorm" if mode == "gpu" else "paratrain.nn.syncbn.SyncBatchNorm"
    for r in results:
        if r["kinds"] != [want_kind]:
            raise CheckFailed(f"sync_batchnorm=True on {r['device']} gave {r['kinds']}, not [{want_kind}]")
    err, key = _state_rel(results[0]["state"], {k: v.cpu() for k, v in ref.state_dict().items()})
    agree, _ = _state_rel(results[1]["state"], results[0]["state"])
    print(f"ranks on {[r['device'] for r in results]} over {results[0]['backend']}: worst vs one process {key} "
          f"{err:.2e}; rank 1 vs rank 0 {agree:.2e}")
    if not (err <= 1e-4 and agree <= 1e-6):
        raise CheckFailed(f"SyncBatchNorm x2 differs from BatchNorm over the whole batch: {key} {err:.2e} > 1e-4 "
                          f"(ranks apart by {agree:.1e})")
    return Result(f"{want_kind.rsplit('.', 1)[-1]} ({want_kind.split('.')[0]}) x2 on {results[0]['device']} over "
                  f"{results[0]['backend']}: 5 steps = one process with BatchNorm (rel. {err:.1e})",
                  {"kind": want_kind, "rel_err": err, "device": results[0]["device"]})
