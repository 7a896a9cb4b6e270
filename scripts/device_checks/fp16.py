"""The device check: fp16-mixed with a GradScaler."""

from __future__ import annotations

import copy

from .base import CheckFailed, Result, _batches, _device, _mlp, _plain_sgd, _state_rel, check


@check
def fp16_scaler(mode: str, budget: float) -> Result:
    """A Parallel loop in fp16-mixed: its scaler is torch.amp's GradScaler for the device, training
    follows the fp32 loop, and an inf loss skips the step, keeps the weights and halves the scale."""
    import torch
    import torch.nn.functional as F

    import paratrain

    device = _device(mode)
    batches = _batches(12, 32, (64,))
    torch.manual_seed(1)
    ref = _mlp().to(device)
    model = copy.deepcopy(ref)
    ref_losses = _plain_sgd(ref, batches, device)

    pt = paratrain.Parallel(strategy="single", precision="fp16-mixed", global_batch=32,
                            accelerator="cuda" if mode == "gpu" else "cpu")
    scaler = getattr(pt.precision, "scaler", None)
    if not isinstance(scaler, torch.amp.GradScaler):
        raise CheckFailed(f"fp16-mixed's scaler is {type(scaler).__name__}, not torch.amp.GradScaler")
    scaler_device = getattr(scaler, "_device", None)
    if scaler_device != device.type:
        raise CheckFailed(f"fp16-mixed's GradScaler is for {scaler_device!r}, not {device.type!r}")
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(pt.device)), y.to(pt.device))
        pt.backward(loss)
        opt.step()
        losses.append(float(loss.detach()))
    err, key = _state_rel(pt.unwrap(model).state_dict(), ref.state_dict())
    print(f"final loss fp16-mixed {losses[-1]:.5f} vs fp32 {ref_losses[-1]:.5f}; worst parameter {key}: {err:.2e}; "
          f"scale {pt.precision.loss_scale}")
    if not err <= 2e-2:
        raise CheckFailed(f"fp16-mixed drifts from the fp32 loop after {len(batches)} steps: {key} {err:.2e} > 2e-2")
    if pt.skipped_steps:
        raise CheckFailed(f"fp16-mixed skipped {pt.skipped_steps} of {len(batches)} ordinary steps")

    before = {k: v.clone() for k, v in pt.unwrap(model).state_dict().items()}
    scale = pt.precision.loss_scale
    x, y = batches[0]
    opt.zero_grad()
    pt.backward(F.cross_entropy(model(x.to(pt.device)), y.to(pt.device)) * float("inf"))
    opt.step()
    after = pt.unwrap(model).state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    print(f"inf loss: skipped steps {pt.skipped_steps}, scale {scale} -> {pt.precision.loss_scale}, moved {moved}")
    if pt.skipped_steps != 1 or moved or not pt.precision.loss_scale < scale:
        raise CheckFailed(f"an inf loss was not skipped: skipped_steps {pt.skipped_steps}, parameters moved {moved}, "
                          f"scale {scale} -> {pt.precision.loss_scale}")
    pt.close()
    return Result(f"torch.amp.GradScaler('{device.type}'); 12 steps within {err:.1e} of fp32; an inf step skipped, "
                  f"scale {scale:g} -> {pt.precision.loss_scale:g}",
                  {"rel_err": err, "scaler_device": scaler_device})
