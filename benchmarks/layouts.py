"""The layouts side by side at world size 4: ``paratrain bench`` with composed meshes beside ddp and fsdp.

What it measures
    ``paratrain bench --world-sizes 4`` on the built-in transformer (digits), fp32, one process per
    CPU "device": ddp x4 and fsdp x4, and the layouts HSDP ``dp_replicate=2,dp_shard=2``,
    ``dp_shard=2,tp=2``, ``pp=2,dp_shard=2`` and ``pp=2,tp=2``; for each, the step time, samples per
    second, each rank's peak memory and the busiest rank's bytes per step, and the loss and test
    accuracy (equal across layouts: the result does not depend on the layout). The table is
    bench's own (``docs/bench.md`` says how each column is measured).

Target
    none: the numbers are this machine's. Every layout trains to the same loss as ddp.

Usage::

    python benchmarks/layouts.py [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-4  # fp32: each layout sums its gradients in its own order
MESHES = ["dp_replicate=2,dp_shard=2", "dp_shard=2,tp=2", "pp=2,dp_shard=2", "pp=2,tp=2"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one epoch, one layout (pp=2,dp_shard=2) and ddp: that it runs, not its numbers")
    ap.add_argument("--out", default=None, help="where bench writes results.json/.csv and chart.png (default: a temporary folder)")
    args = ap.parse_args(argv)
    meshes = MESHES[2:3] if args.smoke else MESHES
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or os.path.join(tmp, "bench")
        cmd = [sys.executable, "-m", "paratrain", "bench", "--quick", "--model", "transformer", "--world-sizes", "4",
               "--strategies", "ddp" if args.smoke else "ddp,fsdp", "--precisions", "32", "--comm-hooks", "none",
               "--no-baseline", "--no-trap", "--no-progress", "--epochs", "1" if args.smoke else "3", "--out", out]
        for mesh in meshes:
            cmd += ["--mesh", mesh]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        res = subprocess.run(cmd, env=env, cwd=tmp)
        if res.returncode:
            return res.returncode
        with open(os.path.join(out, "results.json")) as f:
            rows = [r for r in json.load(f)["cells"] if r.get("final_loss") is not None]
    losses = [r["final_loss"] for r in rows]
    spread = (max(losses) - min(losses)) / abs(min(losses)) if losses else float("inf")
    same = bool(rows) and spread < TOLERANCE
    print(f"{len(rows)} configurations trained; final losses {min(losses):.6f}..{max(losses):.6f} (relative spread "
          f"{spread:.1e}): {'the same in every layout' if same else 'they differ'} (tolerance {TOLERANCE:g}, fp32)")
    return 0 if same else 1

if __name__ == "__main__":
    sys.exit(main())
