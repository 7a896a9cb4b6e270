"""The device check: torch.compile against eager."""

from __future__ import annotations

import copy
import time
from typing import Any

from .base import CHECKS, CheckFailed, Result, _batches, _bn_cnn, _device, _state_rel


def compile_check(mode: str, budget: float) -> Result:
    """``Parallel(compile=True)`` (inductor on the GPU; ``aot_eager`` on the CPU twin, which needs
    no C++ compiler and takes seconds) against the same loop uncompiled."""
    import torch
    import torch.nn.functional as F

    import paratrain

    device = _device(mode)
    backend = "inductor" if mode == "gpu" else "aot_eager"
    batches = _batches(6, 32, (3, 16, 16))
    torch.manual_seed(1)
    base = _bn_cnn()
    out: dict[bool, Any] = {}
    seconds = {}
    for compiled in (False, True):
        pt = paratrain.Parallel(strategy="single", compile=compiled, compile_backend=backend, global_batch=32,
                                accelerator="cuda" if mode == "gpu" else "cpu")
        m = copy.deepcopy(base)
        model, opt = pt.setup(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9))
        t0 = time.monotonic()
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(pt.device)), y.to(pt.device))
            pt.backward(loss)
            opt.step()
            losses.append(float(loss.detach()))
        seconds[compiled] = time.monotonic() - t0
        out[compiled] = ({k: v.detach().cpu() for k, v in model.state_dict().items()}, losses)
        pt.close()
    (eager, eager_losses), (comp, comp_losses) = out[False], out[True]
    if set(comp) != set(eager):  # a compiled model's state keeps the uncompiled keys (no _orig_mod.)
        raise CheckFailed(f"the compiled model's state keys differ: {sorted(set(comp) ^ set(eager))[:4]}")
    err, key = _state_rel(comp, eager)
    print(f"losses eager {eager_losses}\n       compiled {comp_losses}\nworst parameter {key}: {err:.2e}; "
          f"{seconds[True]:.1f} s compiled (compilation included), {seconds[False]:.2f} s eager")
    if not err <= 1e-3:
        raise CheckFailed(f"torch.compile ({backend}) drifts from eager after {len(batches)} steps: "
                          f"{key} {err:.2e} > 1e-3")
    return Result(f"Parallel(compile=True), {backend} on {device}: {len(batches)} steps = eager (rel. {err:.1e}); "
                  f"{seconds[True]:.0f} s with compilation", {"backend": backend, "rel_err": err,
                                                              "compiled_s": seconds[True], "eager_s": seconds[False]})


CHECKS["compile"] = compile_check
