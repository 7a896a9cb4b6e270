"""``paratrain doctor RUN_DIR``: the post-mortem of a run that failed or hung, read from what it left.

Each rank's record of its collectives (``trace/rank-N.trace``: ``paratrain train`` keeps them in
its run folder, ``paratrain run --log-dir DIR`` in ``DIR``, any job in ``$PARATRAIN_TRACE_DIR``),
or, for a job that ran elsewhere, PyTorch's Flight Recorder dumps (one file per rank, its name
ending in the rank: NCCL's ``nccl_trace_rank_N``), are read back: the first collective where the ranks went different ways, in one line (a skipped
collective, other sizes, another op, a rank that never arrived), then each rank's last collectives.
It works on a run that is over, on one a scheduler killed, and on one still hanging.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="read a failed or hung run's records: which rank, which collective, why",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", nargs="?", default="runs/latest", metavar="RUN_DIR",
                   help="a run folder, or the folder of its rank-N.trace files (default: runs/latest)")
    p.add_argument("--last", type=int, default=12, metavar="N", help="each rank's last N collectives in the table")
    p.set_defaults(func=main)
    return p


def read_records(run_dir: str) -> tuple[str, str, dict[int, Any]]:
    """``(folder, what, records)``: paratrain's records of ``run_dir`` (``trace/rank-N.trace`` or
    ``rank-N.trace``), else the Flight Recorder dumps in it; a one-line error when there are neither."""
    from ..trace.flight import read_flight_dumps
    from ..trace.recorder import read_dir

    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir!r} is not a folder: give a run folder (runs/latest), the --log-dir of "
                                "paratrain run, or a folder of Flight Recorder dumps")
    for folder in (os.path.join(run_dir, "trace"), run_dir):
        records = read_dir(folder)
        if records:
            return folder, "records", records
    dumps = read_flight_dumps(run_dir)
    if dumps:
        return run_dir, "Flight Recorder dumps", dumps
    raise FileNotFoundError(f"{run_dir!r} holds no records of collectives (trace/rank-N.trace) and no Flight Recorder "
                            "dumps: give a run folder of paratrain train, the --log-dir of paratrain run, a "
                            "PARATRAIN_TRACE_DIR, or the folder of TORCH_FR_DUMP_TEMP_FILE")


def main(args: argparse.Namespace) -> int:
    from ..trace.analyze import first_divergence, table

    if args.last < 1:
        raise ValueError(f"--last {args.last} must be at least 1")
    folder, what, records = read_records(args.run_dir)
    finding = first_divergence(records)
    ranks = sorted(records)
    pending = [f"rank {r} in {rec.op} #{rec.seq}" for r in ranks for rec in records[r][-1:] if rec.state != "done"]
    print(f"{what} of {len(ranks)} rank(s) ({', '.join(map(str, ranks))}) in {folder}")
    if finding is not None:
        print(f"doctor: {finding.line}")
    else:
        print("doctor: the ranks agree on every collective they all recorded"
              + (f"; still waiting: {', '.join(pending)}" if pending else ""))
    print()
    print(table(records, args.last), end="")
    return 1 if finding is not None else 0
