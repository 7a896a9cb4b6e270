"""What every device check shares: :class:`Result`, :class:`CheckFailed`, :class:`Skip`, the
registry ``CHECKS`` (filled by :func:`check`) and the helpers (device, references, subprocess runs)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CheckFailed(Exception):
    """A check ran and found a wrong result (the message is its one-line reason)."""


class Skip(Exception):
    """A check cannot run here (the message says why: no CUDA, a package missing...)."""


@dataclass
class Result:
    summary: str
    """One line: what was compared and how close it came."""
    details: dict[str, Any] = field(default_factory=dict)


CHECKS: dict[str, Callable[[str, float], Result]] = {}


def check(fn: Callable[[str, float], Result]) -> Callable[[str, float], Result]:
    CHECKS[fn.__name__] = fn
    return fn


# --------------------------------------------------------------------------- helpers


def _device(mode: str) -> Any:
    import torch

    if mode == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Skip(f"no CUDA: torch {torch.__version__} sees no GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # the references compare in true fp32
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", 0)


def _rel(a: Any, b: Any) -> float:
    """Relative difference of two tensors (max |a-b| / max |b|), in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _state_rel(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, str]:
    """The largest relative difference over the floating tensors of two state dicts, and its key."""
    worst, where = 0.0, next(iter(want), "")
    for k, v in want.items():
        if not getattr(v, "is_floating_point", lambda: False)():
            continue
        if k not in got:
            raise CheckFailed(f"state key {k!r} missing (got {sorted(got)[:6]}...)")
        r = _rel(got[k], v)
        if r > worst or r != r:  # NaN counts as the worst
            worst, where = r, k
    return worst, where


def _mlp(features: int = 64, hidden: int = 128, classes: int = 10) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def _bn_cnn(classes: int = 10) -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, classes))


def _batches(steps: int, batch: int, shape: tuple[int, ...], classes: int = 10, seed: int = 0) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn((batch, *shape), generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(steps)]


def _plain_sgd(model: Any, batches: list[Any], device: Any, lr: float = 0.05) -> list[float]:
    """The reference: a plain fp32 PyTorch loop, one SGD step per batch; the losses."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _run(args: list[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    """``python ARGS`` from the checkout (its output echoed into this check's log); a failure is
    :class:`CheckFailed` with the command's last line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    print(f"$ {' '.join(args)}", flush=True)
    t0 = time.monotonic()
    try:
        res = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise CheckFailed(f"{what} ran past {timeout:.0f} s") from e
    print(res.stdout[-4000:], res.stderr[-4000:], f"({time.monotonic() - t0:.1f} s, exit {res.returncode})",
          sep="\n", flush=True)
    if res.returncode != 0:
        last = (res.stderr.strip() or res.stdout.strip() or "no output").splitlines()[-1]
        raise CheckFailed(f"{what} exited with {res.returncode}: {last[:300]}")
    return res
