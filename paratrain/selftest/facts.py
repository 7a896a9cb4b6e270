"""Device facts: what this torch and this hardware support (bf16, TF32, fp16, compute capability,
NCCL, peer access between GPUs, ``torch.compile``)."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
from typing import Any

import torch

__all__ = ["device_facts", "compile_probe", "COMPILE_PROBE"]


def device_facts() -> dict[str, Any]:
    """The facts that cost nothing to read (no kernel is compiled)."""
    from .. import __version__
    from ..env.devices import available_accelerator

    found = available_accelerator()
    cuda = found is not None and found[0] == "cuda"
    facts: dict[str, Any] = {
        "paratrain": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch build": f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU",
        "accelerator": f"{found[0]} x{found[1]}" if found else "none (CPU)",
        "CPU cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
        "nccl": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
    }
    if cuda:
        n = torch.cuda.device_count()
        caps = [torch.cuda.get_device_capability(i) for i in range(n)]
        facts["GPUs"] = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
        facts["compute capability"] = ", ".join(f"{a}.{b}" for a, b in caps)
        facts["GPU memory GiB"] = ", ".join(f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f}"
                                           for i in range(n))
        facts["bf16"] = torch.cuda.is_bf16_supported()
        facts["tf32"] = all(a >= 8 for a, _ in caps)  # Ampere and later
        facts["fp16"] = True
        try:
            facts["NCCL version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError) as e:
            facts["NCCL version"] = f"unknown ({str(e).splitlines()[0]})"
        pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
        facts["peer access (P2P)"] = ("n/a (one GPU)" if not pairs else
                                      f"{sum(torch.cuda.can_device_access_peer(i, j) for i, j in pairs)}/{len(pairs)} "
                                      "GPU pairs")
        facts["NVLink"] = _nvlink()
    else:
        facts["bf16"] = _cpu_autocast(torch.bfloat16)
        facts["fp16"] = _cpu_autocast(torch.float16)
        facts["tf32"] = False
    return facts


def _cpu_autocast(dtype: torch.dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            out = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        return out.dtype == dtype
    except (RuntimeError, TypeError):
        return False


def _nvlink() -> str:
    """NVLink as ``nvidia-smi nvlink --status`` sees it (torch does not expose it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (no nvidia-smi)"
    try:
        out = subprocess.run([smi, "nvlink", "--status"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"
    links = [ln for ln in out.splitlines() if "Link" in ln and "GB/s" in ln]
    return f"{len(links)} active links" if links else "none reported"


COMPILE_PROBE = """
import torch
dev = "cuda" if torch.cuda.is_available() else "cpu"
m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(dev)
x = torch.randn(8, 16, device=dev)
c = torch.compile(m)
out = c(x)
out.sum().backward()
assert torch.allclose(out, m(x), rtol=1e-4, atol=1e-5), "compiled output differs"
print("ok")
"""


def compile_probe(timeout: float) -> tuple[bool | None, str]:
    """Whether ``torch.compile`` (inductor) compiles and runs a small model, forward and backward,
    in a fresh process within ``timeout`` seconds: (True/False, why), or (None, why) if undecided."""
    proc = subprocess.Popen([sys.executable, "-c", COMPILE_PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # inductor's compile workers too
        proc.communicate()
        return None, f"not settled within {timeout:.0f} s (the first compile is slow on a small CPU)"
    if proc.returncode == 0:
        return True, "compiles and matches eager, forward and backward"
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return False, lines[-1] if lines else f"exit code {proc.returncode}"
