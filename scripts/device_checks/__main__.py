"""``python scripts/device_checks NAME --mode gpu|cpu --budget S --result FILE``: run one check
and write ``{"status": "ok"|"failed"|"skipped", "summary"|"reason": ..., "details": {...}}`` to FILE.
Exit status 0 when it passed or was skipped, 1 when it failed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

# Imported as the top-level ``device_checks`` from scripts/, first on the path: a ``scripts`` package
# that some wheel installs into site-packages would otherwise shadow this checkout's (a namespace
# package loses to a regular one). spawn's workers get this sys.path, so they find it too.
_SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.dirname(_SCRIPTS), _SCRIPTS):
    if _p in sys.path:
        sys.path.remove(_p)
    sys.path.insert(0, _p)

from device_checks import CHECKS, CheckFailed, Skip  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("name", choices=sorted(CHECKS))
    ap.add_argument("--mode", choices=["gpu", "cpu"], default="gpu",
                    help="gpu: the check itself; cpu: its CPU twin at tiny size (device_check --dry-run)")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds the driver gives this check")
    ap.add_argument("--result", required=True, help="where the JSON result goes")
    args = ap.parse_args()
    t0 = time.monotonic()
    try:
        res = CHECKS[args.name](args.mode, args.budget)
        out: dict[str, Any] = {"status": "ok", "summary": res.summary, "details": res.details}
    except Skip as e:
        out = {"status": "skipped", "reason": str(e)}
    except CheckFailed as e:
        out = {"status": "failed", "reason": str(e)}
    except Exception as e:  # a crash: the traceback goes to the log, its last line to the summary
        traceback.print_exc()
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        out = {"status": "failed", "reason": f"{type(e).__name__}: {last}"}
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(f"{args.name}: {out['status']}: {out.get('summary') or out.get('reason')}", flush=True)
    tmp = args.result + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1, default=str)
    os.replace(tmp, args.result)
    return 1 if out["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
