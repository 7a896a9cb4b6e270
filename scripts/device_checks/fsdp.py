"""The device check: fsdp + bf16-mixed against single, and cpu_offload against fsdp."""

from __future__ import annotations

import json
import os

from .base import CheckFailed, Result, _device, _run, check


@check
def fsdp_bf16(mode: str, budget: float) -> Result:
    """``paratrain train --strategy fsdp --precision bf16-mixed`` against ``--strategy single`` at
    the same precision (on the GPU at world size 1 over nccl; on the CPU at world size 2 over gloo),
    and fsdp with ``cpu_offload`` (parameters, gradients and optimizer state in host memory: FSDP2's
    ``CPUOffloadPolicy``) against fsdp without it, on the GPU (on the CPU it is a no-op, not run)."""
    _device(mode)
    import tempfile

    steps, nproc, model = ("30", "1", "cnn") if mode == "gpu" else ("8", "2", "mlp")
    job = ["-m", "paratrain", "train", "--model", model, "--precision", "bf16-mixed", "--max-steps", steps,
           "--no-progress"]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="device-check-fsdp-") as tmp:
        for name, extra in (("single", ["--strategy", "single"]),
                            ("fsdp", ["--strategy", "fsdp", "--nproc-per-node", nproc]),
                            ("offload", ["--strategy", "fsdp", "--nproc-per-node", nproc,
                                         "--set", "parallel.fsdp.cpu_offload=true"])):
            if name == "offload" and mode == "cpu":  # a no-op on the CPU (the states are in host memory): not run
                runs[name] = runs["fsdp"]
                continue
            d = os.path.join(tmp, name)
            _run([*job, *extra, "--log-dir", d], budget / (3 if mode == "gpu" else 2), f"train {' '.join(extra)}")
            with open(os.path.join(d, "result.json")) as f:
                runs[name] = json.load(f)
    single, fsdp, offload = runs["single"], runs["fsdp"], runs["offload"]
    if fsdp["world_size"] != int(nproc) or fsdp["steps"] != int(steps):
        raise CheckFailed(f"fsdp ran {fsdp['steps']} steps at world size {fsdp['world_size']}, not {steps} at {nproc}")
    device = fsdp["provenance"]["world"]["device"]
    if mode == "gpu" and not str(device).startswith("cuda"):
        raise CheckFailed(f"fsdp ran on {device}, not on the GPU")
    loss_err = abs(fsdp["test_loss"] - single["test_loss"]) / abs(single["test_loss"])
    acc_diff = abs(fsdp["test_accuracy"] - single["test_accuracy"])
    line = (f"after {steps} steps: test loss fsdp {fsdp['test_loss']:.4f} vs single {single['test_loss']:.4f} "
            f"(rel. {loss_err:.1e}), accuracy {fsdp['test_accuracy']:.2%} vs {single['test_accuracy']:.2%}")
    print(line)
    if not (loss_err <= 0.05 and acc_diff <= 0.05):  # fsdp computes in bf16 weights, single under autocast
        raise CheckFailed(f"fsdp bf16-mixed x{nproc} is not single's result: {line}")
    offload_err = abs(offload["test_loss"] - fsdp["test_loss"]) / abs(fsdp["test_loss"])
    offload_line = f"cpu_offload test loss {offload['test_loss']:.4f} (rel. {offload_err:.1e} to fsdp)"
    print(offload_line)
    if not offload_err <= 1e-2:  # the same bf16 computation; only where the states live differs
        raise CheckFailed(f"fsdp cpu_offload x{nproc} is not fsdp's result: {offload_line}")
    return Result(f"fsdp bf16-mixed x{nproc} on {device} = single bf16-mixed: {line}; {offload_line}",
                  {"device": device, "world_size": int(nproc), "test_loss": fsdp["test_loss"],
                   "single_test_loss": single["test_loss"], "rel_err": loss_err,
                   "cpu_offload_test_loss": offload["test_loss"], "cpu_offload_rel_err": offload_err})
