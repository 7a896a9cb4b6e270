"""The ranks' records side by side: the first collective where they went different ways, in one line.

The ranks of a process group call its collectives in the same order, so the ``n``-th call on a
group is the same collective on every rank (:attr:`~paratrain.trace.recorder.Record.seq`). The
first number where the ranks' calls differ, or where some ranks have not arrived, is where the
job went wrong:

* a rank **skipped** a collective: at that number it is already in a later one, a step (or a
  micro-step) ahead of the ranks that wait in the skipped one;
* the ranks called the same collective with **different sizes** or dtypes (gloo aborts the process);
* they called **different collectives** at the same point (each waits for a partner that never comes);
* a rank **never arrived**: the others wait in a collective it has not reached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:  # the records only pass through here: the recorder asks this module in checked mode
    from .recorder import Record

__all__ = ["Finding", "first_divergence", "explain", "cause", "table"]


@dataclass
class Finding:
    """Where the ranks of one process group first differ."""

    kind: str
    """``skipped``, ``sizes``, ``ops`` or ``missing``."""
    group: str
    seq: int
    at: dict[int, Record]
    """Each rank's record at ``seq`` (the ranks that have one)."""
    missing: list[int] = field(default_factory=list)
    """Ranks of the group with no record at ``seq`` (they have not reached it)."""
    last: dict[int, Record] = field(default_factory=dict)
    """For each missing rank, its last record on the group (None: it recorded none there)."""
    line: str = ""


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _who(r: Record) -> str:
    return f"{r.by}'s " if r.by and r.by != "paratrain" else ""


def _where(r: Record) -> str:
    parts = [p for p in (r.where, "backward" if r.by == "DDP" else "", f"step {r.step}" if r.step >= 0 else "") if p]
    return "(" + ", ".join(parts) + ")" if parts else ""


def describe(r: Record) -> str:
    """``DDP's all_reduce #58 (train.py:40, step 4)``."""
    return f"{_who(r)}{r.op} #{r.seq} {_where(r)}".rstrip()


def _size(r: Record) -> str:
    if r.numel < 0:
        return "no tensor"
    return f"{r.numel} {r.dtype}".strip()


def _by_position(records: Mapping[int, Sequence[Record]]) -> dict[str, dict[int, dict[int, Record]]]:
    groups: dict[str, dict[int, dict[int, Record]]] = {}
    for rank, recs in records.items():
        for r in recs:
            groups.setdefault(r.group, {}).setdefault(rank, {})[r.seq] = r
    return groups


def first_divergence(records: Mapping[int, Sequence[Record]]) -> Finding | None:
    """The earliest point (by the time its first record was written) where the ranks of a group differ; None if
    they agree on every collective they all hold."""
    found: list[tuple[float, Finding]] = []
    for group, ranks in _by_position(records).items():
        if len(ranks) < 2:
            continue
        lo = max(min(seqs) for seqs in ranks.values())  # each ring may have lost its oldest records
        hi = max(max(seqs) for seqs in ranks.values())
        for seq in range(lo, hi + 1):
            at = {rank: seqs[seq] for rank, seqs in ranks.items() if seq in seqs}
            missing = sorted(rank for rank in ranks if seq not in ranks[rank])
            if len({(r.op, r.numel, r.dtype) for r in at.values()}) > 1 or missing:
                last = {rank: max((r for s, r in ranks[rank].items() if s < seq), key=lambda r: r.seq, default=None)
                        for rank in missing}
                finding = Finding(_kind(at, missing), group, seq, at, missing,
                                  {rank: r for rank, r in last.items() if r is not None})
                found.append((min(r.time for r in at.values()), finding))
                break
    if not found:
        return None
    finding = min(found, key=lambda tf: tf[0])[1]
    finding.line = _line(finding, len({r.group for recs in records.values() for r in recs}) > 1)
    return finding


def _kind(at: Mapping[int, Record], missing: Sequence[int]) -> str:
    if missing and len({(r.op, r.numel, r.dtype) for r in at.values()}) <= 1:
        return "missing"
    if len({(r.step, r.micro) for r in at.values()}) > 1:
        return "skipped"
    if len({r.op for r in at.values()}) > 1:
        return "ops"
    return "sizes"


def _clusters(at: Mapping[int, Record], key: object) -> list[list[int]]:
    out: dict[object, list[int]] = {}
    for rank, r in sorted(at.items()):
        out.setdefault(key(r), []).append(rank)  # type: ignore[operator]
    return sorted(out.values(), key=lambda ranks: (-len(ranks), ranks[0]))


def _line(f: Finding, several_groups: bool) -> str:
    on = f" on process group {f.group!r}" if several_groups else ""
    if f.kind == "skipped":
        # the ranks furthest ahead skipped what the others wait in
        ahead = max((r.step, r.micro) for r in f.at.values())
        skipped = sorted(rank for rank, r in f.at.items() if (r.step, r.micro) == ahead)
        waiting = sorted(rank for rank in f.at if rank not in skipped)
        w, s = f.at[waiting[0]], f.at[skipped[0]]
        return (f"{_ranks(skipped)} skipped {_who(w)}{w.op} #{w.seq} {_where(w)}{on}: {_ranks(waiting)} "
                f"{'waits' if len(waiting) == 1 else 'wait'} in it, {_ranks(skipped)} "
                f"{'is' if len(skipped) == 1 else 'are'} already in {describe(s)}")
    if f.kind == "sizes":
        parts = []
        for ranks in _clusters(f.at, lambda r: (r.numel, r.dtype)):
            r = f.at[ranks[0]]
            parts.append(f"{_size(r)} on {_ranks(ranks)} ({r.where or r.by or '?'})")
        r0 = next(iter(f.at.values()))
        at = f" at step {r0.step}" if r0.step >= 0 else ""
        return (f"{_who(r0)}{r0.op} #{f.seq}{on}{at} got " + " and ".join(parts)
                + ": every rank must pass the same size")
    if f.kind == "ops":
        parts = [f"{_ranks(ranks)} in {describe(f.at[ranks[0]])}" for ranks in _clusters(f.at, lambda r: r.op)]
        return (f"the ranks called different collectives as #{f.seq}{on}: " + ", ".join(parts)
                + " (code that runs a collective on some ranks only?)")
    r = next(iter(f.at.values()))
    where = "; ".join(f"rank {rank}'s last was {describe(f.last[rank])}" if rank in f.last
                      else f"rank {rank} recorded none there" for rank in f.missing)
    return (f"{_ranks(f.missing)} did not reach {describe(r)}{on}, where {_ranks(sorted(f.at))} "
            f"{'waits' if len(f.at) == 1 else 'wait'}: {where}")


def explain(records: Mapping[int, Sequence[Record]]) -> str | None:
    """The one line for :func:`first_divergence`, or None."""
    finding = first_divergence(records)
    return finding.line if finding else None


_EXPLAINED = ("CollectiveTimeoutError", "PeerLostError")


def cause(records: Mapping[int, Sequence[Record]], failed: int | None = None,
          message: str = "") -> tuple[str, bool] | None:
    """What a launcher says about a failed job from its ranks' records: ``(text, decisive)``, or None.

    Ranks that went different ways (a skipped collective, other sizes, another op) are the cause,
    whatever the first failure said (a SIGABRT from gloo's size check, a lost peer): that line,
    decisive (it replaces the failure's own); so are ranks that never arrived where the failed
    rank, killed by a signal (``message`` empty), was waiting. Otherwise a clause to add to the failed rank's error
    (``failed``, its ``message``): the collective it left the others waiting in, or the step it was
    at and its last collective. Nothing after a timeout's own line, which compared the records."""
    finding = first_divergence(records)
    if finding is not None and finding.kind != "missing":
        return finding.line, True
    if message.split(":")[0].strip().rpartition(".")[2] in _EXPLAINED or failed is None:
        return None
    if finding is not None and not message and failed in finding.at:
        # killed waiting (NCCL's watchdog aborts a rank whose collective timed out): the ranks that
        # never arrived are the news, not the one the watchdog ended
        return finding.line, True
    if finding is not None and failed in finding.missing:
        r = next(iter(finding.at.values()))
        waiting = sorted(finding.at)
        return (f"{_ranks(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in {describe(r)}, which "
                f"{_ranks(finding.missing)} did not reach"), False
    mine = records.get(failed) or []
    if not mine:
        return None
    last = mine[-1]
    return f"rank {failed}'s last collective was {describe(last)}, {last.state}", False


def table(records: Mapping[int, Sequence[Record]], last: int = 12) -> str:
    """Each rank's last ``last`` records, a column per field: what ``logs/collectives.txt`` holds."""
    head = ("rank", "seq", "op", "group", "size", "step", "micro", "state", "by", "where")
    rows = [(str(r.rank), str(r.seq), r.op, r.group, _size(r), str(r.step) if r.step >= 0 else "-",
             str(r.micro) if r.step >= 0 else "-", r.state, r.by or "you", r.where)
            for rank in sorted(records) for r in list(records[rank])[-last:]]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*row).rstrip() for row in (head, *rows)) + "\n"
