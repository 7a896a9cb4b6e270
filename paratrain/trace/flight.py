"""PyTorch's Flight Recorder dumps read as paratrain's records, for ``paratrain doctor``.

A job run with ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (or ``TORCH_FR_BUFFER_SIZE``) keeps a ring of its
process groups' collectives in C++, and NCCL writes it out when a collective times out
(``TORCH_NCCL_DUMP_ON_TIMEOUT``: a file per rank, ``$TORCH_FR_DUMP_TEMP_FILE<rank>``, by default
``/tmp/nccl_trace_rank_<rank>``); ``torch._C._distributed_c10d._dump_fr_trace()`` gives the same on
demand. Each entry names its process group, its sequence number there, the op, the input sizes and
dtypes, its state and the Python stack. Read here without running pickled code (the dumps are
pickles of plain dicts and lists: :class:`_PlainUnpickler` refuses anything else), each becomes a
:class:`~paratrain.trace.recorder.Record` (no step: the recorder knows none), so the same analysis
names the first collective where the ranks differ.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
from typing import Any

from .recorder import Record, caller_of_frames

__all__ = ["read_flight_dumps", "records_of_dump"]

_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}
_STATES = {"completed": "done"}  # started, scheduled: Flight Recorder's own words


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers only: a file that asks for any class is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data: not a Flight Recorder dump")


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            data = f.read(64 << 20)
        dump = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - not a dump (another file of the folder)
        return None
    return dump if isinstance(dump, dict) and isinstance(dump.get("entries"), list) else None


def records_of_dump(dump: dict[str, Any], rank: int) -> list[Record]:
    """One rank's dump as records, oldest first (point-to-point entries left out, as the recorder does)."""
    out = []
    for e in dump["entries"]:
        if e.get("is_p2p"):
            continue
        sizes = e.get("input_sizes") or []
        numel = sum(math.prod(s) for s in sizes) if sizes else -1
        dtypes = e.get("input_dtypes") or []
        frames = [(f.get("filename", ""), int(f.get("line", 0))) for f in e.get("frames") or []]
        by, where = caller_of_frames(frames)
        group = e.get("process_group") or ("", "")
        out.append(Record(rank=rank, seq=int(e.get("collective_seq_id", 0)),
                          op=str(e.get("profiling_name", "")).rpartition(":")[2], group=str(group[0]), numel=numel,
                          dtype=_DTYPES.get(dtypes[0], str(dtypes[0]).lower()) if dtypes else "", step=-1, micro=0,
                          state=_STATES.get(str(e.get("state")), str(e.get("state"))), by=by, where=where,
                          time=(e.get("time_created_ns") or 0) / 1e9))
    return sorted(out, key=lambda r: r.time)


def read_flight_dumps(folder: str) -> dict[int, list[Record]]:
    """Every rank's Flight Recorder dump in ``folder`` (a file whose name ends in its rank, as NCCL names them)."""
    out: dict[int, list[Record]] = {}
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return out
    for name in names:
        m = re.search(r"(\d+)$", name)
        path = os.path.join(folder, name)
        if m is None or not os.path.isfile(path):
            continue
        dump = _load(path)
        if dump is not None:
            out[int(m.group(1))] = records_of_dump(dump, int(m.group(1)))
    return out
