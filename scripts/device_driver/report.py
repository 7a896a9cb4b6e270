"""The summary: ``device_check.json`` and ``device_check.md`` at the top of OUT."""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from typing import Any

from .plan import OPTIONAL
from .runner import Outcome
from .steps import PACKAGE_HINT

__all__ = ["finish", "render_md"]

def finish(out: str, budget: float, args: argparse.Namespace, info: dict[str, Any], outcomes: list[Outcome],
           t_start: float, failed_probe: str | None = None, interrupted: str | None = None) -> int:
    total = time.monotonic() - t_start
    inductor = info.get("cuda") and not args.dry_run  # triton matters only to inductor on CUDA
    missing = sorted(p for p, ok in (info.get("packages") or {}).items()
                     if not ok and p in OPTIONAL and (p != "triton" or inductor))
    optional_skips = [f"{o.name}: {o.summary}" for o in outcomes if o.summary.startswith("package missing")]
    for o in outcomes:
        optional_skips += [f"{o.name}: {r}" for r in o.details.get("skipped_rows", [])]
        optional_skips += [f"{o.name}: {n}" for n in o.details.get("notes", []) if PACKAGE_HINT.search(n)]
    optional_skips = list(dict.fromkeys(optional_skips))  # the same row skipped in several sections: once
    failed = [o for o in outcomes if o.status == "failed"]
    failed += [Outcome(what, "", "failed", why) for what, why in (("probe", failed_probe), ("run", interrupted)) if why]
    summary = {
        "ok": not failed, "interrupted": interrupted, "dry_run": args.dry_run, "budget_s": budget,
        "seconds": round(total, 1), "out": out, "machine": info, "packages_missing": {p: OPTIONAL[p] for p in missing},
        "optional_skipped": optional_skips,
        "steps": [{**asdict(o), "seconds": round(o.seconds, 1),
                   "slice_s": None if o.slice_s is None else round(o.slice_s, 1)} for o in outcomes],
    }
    with open(os.path.join(out, "device_check.json.tmp"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    os.replace(os.path.join(out, "device_check.json.tmp"), os.path.join(out, "device_check.json"))
    md = render_md(summary)
    with open(os.path.join(out, "device_check.md"), "w") as f:
        f.write(md)
    print("\n" + md, flush=True)
    return 1 if failed else 0


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_md(s: dict[str, Any]) -> str:
    m = s["machine"]
    gpus = ", ".join(m.get("gpus") or []) or "none"
    lines = [
        f"# device check{' (dry run: CPU twins at tiny size)' if s['dry_run'] else ''}: "
        f"{'PASS' if s['ok'] else 'FAIL'}",
        "",
        f"torch {m.get('torch', '?')} (CUDA build {m.get('cuda_build')}), GPUs: {gpus}"
        + (f", NCCL {m['nccl']}" if m.get("nccl") else "")
        + f"; {m.get('cores', '?')} cores; python {m.get('python', '?')} ({m.get('executable', m.get('python'))}); "
        f"paratrain {m.get('paratrain', '?')} from {m.get('paratrain_from', '?')}",
        f"{s['seconds']:.0f} s of a {s['budget_s']:.0f} s budget"
        + (f"; {s['interrupted']}: the steps not run are listed as skipped." if s["interrupted"] else "."),
        "",
        "| step | what | status | s / slice | result, reason |",
        "|---|---|---|---|---|",
    ]
    for o in s["steps"]:
        took = f"{o['seconds']:.0f} / {o['slice_s']:.0f}" if o["slice_s"] is not None else "-"
        lines.append(f"| {o['name']} | {_cell(o['what'])} | {o['status']} | {took} | {_cell(o['summary'])} |")
    if s["packages_missing"]:
        lines += ["", "Packages missing here (nothing is installed), and what they would have run:", ""]
        lines += [f"- {p}: {_cell(what)}" for p, what in s["packages_missing"].items()]
    if s["optional_skipped"]:
        lines += ["", "Rows skipped for a missing package:", ""] + [f"- {_cell(x)}" for x in s["optional_skipped"]]
    recorded = [o for o in s["steps"] if o["name"] in ("dataloader", "predict") and o["status"] == "ok"]
    if recorded:
        lines += ["", "Recorded (issue 29, item 4):", ""]
        for o in recorded:
            lines.append(f"- {o['name']}: {_cell(o['summary'])}")
    sm = next((o for o in s["steps"] if o["name"] == "selftest"), None)
    if sm and sm["details"].get("selftest.md"):
        lines += ["", f"selftest's own report: `{sm['details']['selftest.md']}`"]
    lines += ["", "Logs: `<step>.log` in " + f"`{os.path.join(s['out'], 'logs')}`."]
    return "\n".join(lines) + "\n"
