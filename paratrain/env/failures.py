"""Why a collective failed, in one line: the rank that did not arrive (a hang, a frozen process), the
peer that ended first, or a group that never formed, with the collective read off the traceback.

gloo's own errors say only "Timed out" or "Connection reset by peer" on the rank that waited; these
helpers turn them into a :class:`CollectiveTimeoutError` that names the cause, for ``paratrain
train``, ``paratrain.launch`` and (through ``sys.excepthook``) a script's own loop.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .base import CollectiveTimeoutError, PeerLostError

__all__ = ["explain_timeout", "explain_peer_loss", "explain_failure", "collective_of",
           "remember_timeout", "speaks", "is_consequence"]

_joined_timeout_s: float | None = None  # timeout_s of the process group this process joined (see remember_timeout)


def explain_timeout(error: BaseException, timeout_s: float | None, step: int | None = None) -> CollectiveTimeoutError | None:
    """If ``error`` is a collective that timed out, a :class:`CollectiveTimeoutError` that names
    the rank(s) that did not arrive (else None). Call it on every rank that got the error.

    gloo's timeout says only that this rank waited. So every rank that timed out writes where it
    waited (the collective, the :class:`~paratrain.Parallel` call) into the job's store
    (``MASTER_ADDR:MASTER_PORT``), waits a grace period for the others to time out too, and reads
    who wrote: the ranks that did not are the ones that never arrived (a hang, a frozen process);
    ranks that all waited, some in a call of ``Parallel`` and the others elsewhere, are the
    main-process-only mistake, and those elsewhere are named. When the store itself does not
    answer, the rank that serves it (rank 0) is the one that is frozen or gone. NCCL aborts the process on its own
    timeout (its watchdog) before Python sees an error; this covers gloo (CPU).
    """
    if not (_initialized() and isinstance(error, RuntimeError) and "Timed out" in str(error)):
        return None
    me, world = dist.get_rank(), dist.get_world_size()
    grace = _grace(timeout_s)
    at = _where(error, step)
    waited_for = _waited_for(timeout_s)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:  # a group made without env:// (tcp://)
        return CollectiveTimeoutError(f"rank {me} waited {waited_for} in a collective{at}: another rank did not arrive "
                                      "(hung, frozen or unreachable)")
    here = {"call": collective_call(error), "where": at, "records": _last_records()}
    answered, beats = _where_each_waited(here, grace, timeout_s)
    if not answered:  # the store did not answer (not even with this rank's own key)
        return CollectiveTimeoutError(
            f"rank {me} waited {waited_for} in a collective{at}, and the job's store on rank 0 does not "
            "answer either: rank 0 is frozen, gone or unreachable")
    return _who_did_not_arrive(answered, world, waited_for, error, beats)


def _grace(timeout_s: float | None) -> float:
    """How long a rank that timed out waits for the others to time out too: they entered the same collective a little later."""
    return min(5.0, max(2.0, (timeout_s or 10.0) / 5))


def _waited_for(timeout_s: float | None) -> str:
    return f"{timeout_s:g} s (timeout_s)" if timeout_s is not None else "the process group's timeout"


def _where_each_waited(here: dict[str, Any], grace: float, timeout_s: float | None,
                       after_others: bool = False) -> tuple[dict[int, dict[str, Any]], dict[int, bool]]:
    """Write where this rank waited (``here``) into the job's store and read where the others did:
    rank -> where, for every rank that wrote once all did or the patience ran out ({} when the
    store does not answer; ``after_others``: write only if another rank wrote first, else {}), and
    of the ranks that did not write, those whose heartbeat (:mod:`~paratrain.env.heartbeat`) goes on (True) or
    stopped (False: silent), where known.

    Each rank stays at least ``grace`` after its write, so that the others read it (rank 0's
    process may serve the store), and once all wrote, the rank that prints the line ends first.
    Where the main-process-only mistake is likely (rank 0 missing, or this rank waiting in a call
    of Parallel's), a rank still missing after the grace may sit in
    another collective that it entered later (a save after writing its files; a busy machine's
    ranks fall apart): it gets the time to time out too (``timeout_s``, at most 30 s), so that
    the line says where it waited, unless every rank still missing is silent (frozen, gone, its
    host cut off: it will never write). A plain hang is not delayed."""
    from . import heartbeat

    me, world = dist.get_rank(), dist.get_world_size()
    later = min(timeout_s or 10.0, 30.0)
    said: dict[int, dict[str, Any]] = {}
    prefix = f"paratrain/waited/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    watch = heartbeat.Watch(timeout_s)

    def missing() -> list[int]:
        return [r for r in range(world) if r not in said]

    def patience() -> float:
        maybe_elsewhere = 0 not in said or here["call"] is not None
        return grace + (later if maybe_elsewhere and watch.silent(missing()) != missing() else 0.0)

    def read(store: Any) -> None:
        for r in range(world):
            if r not in said and store.check([f"{prefix}{r}"]):
                said[r] = json.loads(store.get(f"{prefix}{r}"))

    def ask_store() -> None:
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                                  timedelta(seconds=grace + 2), wait_for_workers=False)
            if after_others:
                read(store)
                if not said:
                    return
            store.set(f"{prefix}{me}", json.dumps(here))
            start = time.monotonic()
            while True:
                read(store)
                watch.look(store, missing())
                waited = time.monotonic() - start
                if len(said) < world:
                    if waited >= patience():
                        return
                elif me == min(said):  # the rank that prints the line (_said_by) ends first: the others wait
                    if waited >= grace:  # for it, or the agent could stop it before it prints
                        store.set(f"{prefix}said", "1")
                        return
                elif store.check([f"{prefix}said"]):
                    time.sleep(1.0)
                    return
                elif waited >= grace + later + 2:  # not said: that rank is gone
                    return
                time.sleep(0.25)
        except Exception:  # refused, timed out, gone: `said` keeps what was read
            pass

    # In a thread with a deadline: TCPStore's connection check waits without a timeout on a
    # frozen server, and this process must end (the agent then stops the others).
    asking = threading.Thread(target=ask_store, name="paratrain-who-waited", daemon=True)
    asking.start()
    asking.join(grace + 5)
    if asking.is_alive() and said:  # the store answers: waiting for a rank that entered its collective later
        asking.join(later + 2)
    if asking.is_alive() or me not in said:
        return {}, {}
    return dict(said), {**{r: True for r in missing() if r in watch.moved}, **{r: False for r in watch.silent(missing())}}


def _who_did_not_arrive(answered: dict[int, dict[str, Any]], world: int, waited_for: str,
                        error: BaseException, beats: dict[int, bool] | None = None) -> CollectiveTimeoutError:
    """The one line of a timeout from where each rank that timed out waited (``answered``: rank ->
    ``{"call": Parallel's collective method or None, "where": " (op in Parallel.call) at step N"}``),
    and of the missing ranks, whether each still ``beats`` in the job's store, where known.
    Said by the lowest of those ranks only (:func:`speaks`): the others compute the same line."""
    missing = [r for r in range(world) if r not in answered]
    calls = {r: said.get("call") for r, said in answered.items()}
    call = next((calls[r] for r in sorted(calls) if calls[r]), None)
    elsewhere = [r for r in sorted(answered) if calls[r] != call]
    if not missing and call is not None and elsewhere:
        # The main-process-only mistake: some ranks entered Parallel.<call>, the others waited in
        # another collective. Those never arrived, however long the first ones wait.
        inside = [r for r in sorted(answered) if calls[r] == call]
        there = answered[inside[0]]["where"]
        instead = "; ".join(sorted({f"in a collective{answered[r]['where']}" for r in elsewhere}))
        return _said_by(min(answered), CollectiveTimeoutError(
            f"{_ranks(elsewhere)} did not arrive at a collective{there} for {waited_for}: "
            f"{'it' if len(elsewhere) == 1 else 'they'} waited {instead} instead; {_ranks(inside)} waited for "
            f"{'it' if len(elsewhere) == 1 else 'them'} (Parallel.{call} is a collective: does every rank call it, "
            "not the main process only?)"))
    diverged = _records_diverge(answered)
    if diverged is not None:  # the records name the collective each side is in
        return _said_by(min(answered), CollectiveTimeoutError(f"{diverged} (waited {waited_for})"))
    at = answered[min(answered)]["where"]
    beats = beats or {}
    if missing and all(beats.get(r) is False for r in missing):  # never wrote, no heartbeat: no hint of a code mistake
        return _said_by(min(answered), CollectiveTimeoutError(
            f"{_ranks(missing)} did not arrive at a collective{at} for {waited_for}: frozen, gone or unreachable (no "
            f"heartbeat in the job's store); {_ranks(sorted(answered))} waited for {'them' if len(missing) > 1 else 'it'}"))
    if not missing:
        return _said_by(min(answered), CollectiveTimeoutError(
            f"every rank waited {waited_for} in a collective{at}: they wait in different collectives "
            f"{_some_ranks_only(error)}"))
    alive = all(beats.get(r) for r in missing)  # it beats: neither frozen nor cut off, busy somewhere else
    if calls[min(answered)] is not None:
        why = "alive (it beats in the job's store) but busy elsewhere" if alive else "hung, frozen or unreachable"
        hint = f" {_some_ranks_only(error, calls[min(answered)])}"
    elif 0 in missing:  # alive (it serves the store that answered): busy elsewhere, often in a main-process-only call
        why, hint = "hung, or in a collective called on the main process only?", ""
    elif alive:
        why, hint = "hung: alive (it beats in the job's store), but it neither arrived nor timed out elsewhere", ""
    else:
        why, hint = "hung, frozen or unreachable", ""
    return _said_by(min(answered), CollectiveTimeoutError(
        f"{_ranks(missing)} did not arrive at a collective{at} for {waited_for}: {why}; "
        f"{_ranks(sorted(answered))} waited for {'them' if len(missing) > 1 else 'it'}{hint}"))


def _last_records(n: int = 24) -> list[dict[str, Any]]:
    """This rank's last collectives (:mod:`paratrain.trace.recorder`), for the others to compare."""
    from ..trace.recorder import active

    rec = active()
    return [r.as_dict() for r in rec.last(n)] if rec is not None else []


def _records_diverge(answered: dict[int, dict[str, Any]]) -> str | None:
    """The line of the first collective where the ranks that answered went different ways (a skipped
    collective, other sizes, another op), from their records; None if their records agree."""
    from ..trace.analyze import first_divergence
    from ..trace.recorder import Record

    records = {r: [Record(**d) for d in said.get("records") or []] for r, said in answered.items()}
    finding = first_divergence({r: recs for r, recs in records.items() if recs})
    return finding.line if finding is not None and finding.kind != "missing" else None


def _said_by(rank: int, error: CollectiveTimeoutError) -> CollectiveTimeoutError:
    error.speaker = rank
    return error


def speaks(error: BaseException) -> bool:
    """Whether this rank prints ``error``'s line: a timeout's line is the same on every rank that
    waited, and the lowest of them says it; any other error is this rank's own."""
    speaker = getattr(error, "speaker", None)
    return speaker is None or not _initialized() or speaker == dist.get_rank()


# gloo's words (tcp/pair.cc) for a peer whose end of the connection closed: it exited or was killed
_PEER_CLOSED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def explain_peer_loss(error: BaseException, step: int | None = None,
                      grace_s: float = 2.0) -> PeerLostError | CollectiveTimeoutError | None:
    """If ``error`` is a collective whose peer closed its connection, a :class:`PeerLostError`
    saying so in one line (else None), returned after ``grace_s`` seconds.

    The peer ended first: it crashed, or was killed (SIGKILL, the OOM killer). The wait lets the
    launcher see that peer's end before this rank's, so that torchrun's agent reports the rank
    that really failed: with workers started as functions it reports only the first failure it
    sees, and its error files' times would otherwise put this rank's error first.

    Or the peer timed out, in a collective this rank never entered (gloo closes a timed-out
    rank's connections): if it wrote where it waited (:func:`explain_timeout`), this rank writes
    where it waited too, and the :class:`CollectiveTimeoutError` names both sides.
    """
    if not (_initialized() and isinstance(error, RuntimeError)):
        return None
    cause = next((words for words in _PEER_CLOSED if words in str(error)), None)
    if cause is None:
        return None
    time.sleep(grace_s)
    at = _where(error, step)
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        # A peer whose collective timed out closes its connections too (gloo): if one wrote where it
        # waited, this rank waited elsewhere (a collective on some ranks only), not for a crash.
        here = {"call": collective_call(error), "where": at, "records": _last_records()}
        answered, beats = _where_each_waited(here, _grace(_joined_timeout_s), _joined_timeout_s, after_others=True)
        if answered:
            return _who_did_not_arrive(answered, dist.get_world_size(), _waited_for(_joined_timeout_s), error, beats)
    return PeerLostError(f"rank {dist.get_rank()} lost its connection to a peer in a collective{at} ({cause}): another rank "
                         "ended first; its failure is the cause")


def is_consequence(message: str) -> bool:
    """Whether a rank's recorded error (``Type: text``, as in torchrun's error file) is only the
    consequence of another rank's failure: it lost its peer (a :class:`PeerLostError`, or gloo's
    own words for it when the script's ``@record`` wrote the error before paratrain explained it)."""
    return message.startswith(f"{PeerLostError.__name__}: ") or (
        message.startswith("RuntimeError: ") and any(words in message for words in _PEER_CLOSED))


# torch.distributed's collectives, as the frames of a failed one are named
_COLLECTIVES = frozenset((
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv",
))


def collective_of(error: BaseException) -> str:
    """Which collective ``error`` came from, read off its traceback: the innermost
    ``torch.distributed`` collective (``all_reduce``, ``broadcast``, ``barrier``...); a failure
    inside ``backward`` is DDP's (or FSDP's) gradient reduction, which autograd runs."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if frame.name in _COLLECTIVES:
            return frame.name
    if any(frame.name == "backward" for frame in frames):
        return "the gradient reduction in backward"
    return "a collective"


# Parallel's methods that are collectives themselves: each rank must call them
_COLLECTIVE_METHODS = frozenset((
    "save_checkpoint", "load_checkpoint", "evaluate", "full_state_dict", "save_pretrained", "all_gather", "reduce",
    "min_over_ranks",
))
_PARALLEL_FILE = os.path.join("paratrain", "parallel.py")


def collective_call(error: BaseException) -> str | None:
    """The collective method of :class:`~paratrain.Parallel` the failed collective ran in
    (``save_checkpoint``...), read off the traceback; None outside one."""
    for frame in traceback.extract_tb(error.__traceback__):  # outermost first: the user's own call
        if frame.name in _COLLECTIVE_METHODS and frame.filename.endswith(_PARALLEL_FILE):
            return frame.name
    return None


def _where(error: BaseException, step: int | None) -> str:
    """`` (all_reduce in Parallel.save_checkpoint) at step 3``: the collective and the paratrain call
    it ran in, where known, and the step."""
    op, call = collective_of(error), collective_call(error)
    inside = f"Parallel.{call}" if call is not None else ""
    what = " in ".join(x for x in (op if op != "a collective" else "", inside) if x)
    return (f" ({what})" if what else "") + (f" at step {step}" if step is not None else "")


def _some_ranks_only(error: BaseException, call: str | None = None) -> str:
    call = call or collective_call(error)
    if call is None:
        return "(code that runs a collective on some ranks only?)"
    return f"(Parallel.{call} is a collective: does every rank call it, not the main process only?)"


def explain_failure(error: BaseException, step: int | None = None) -> CollectiveTimeoutError | None:
    """:func:`explain_timeout` (with the ``timeout_s`` this process joined with, if paratrain made the group), else
    :func:`explain_peer_loss`: the one-line cause of a failed collective, or None."""
    if isinstance(error, CollectiveTimeoutError):
        return None  # explained already
    return explain_timeout(error, _joined_timeout_s, step) or explain_peer_loss(error, step)


def joined_timeout_s() -> float | None:
    """The ``timeout_s`` this process joined its group with (:func:`remember_timeout`), if paratrain made it."""
    return _joined_timeout_s


def remember_timeout(timeout_s: float) -> None:
    """Record the ``timeout_s`` of the process group this process joined (``init``), for the lines above."""
    global _joined_timeout_s
    _joined_timeout_s = timeout_s


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
