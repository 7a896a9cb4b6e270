"""Why a collective failed, in one line: the rank that did not arrive (a hang, a frozen process), the
peer that ended first, or a group that never formed, with the collective read off the traceback.

gloo's own errors say only "Timed out" or "Connection reset by peer" on the rank that waited; these
helpers turn them into a :class:`CollectiveTimeoutError` that names the cause, for ``paratrain
train``, ``paratrain.launch`` and (through ``sys.excepthook``) a script's own loop.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .base import CollectiveTimeoutError, PeerLostError

__all__ = ["explain_timeout", "explain_peer_loss", "explain_failure", "explain_uncaught", "collective_of",
           "remember_timeout"]

_uncaught = False  # an uncaught exception reached explain_uncaught's hook: the process is failing
_joined_timeout_s: float | None = None  # timeout_s of the process group this process joined (see remember_timeout)


def explain_timeout(error: BaseException, timeout_s: float | None, step: int | None = None) -> CollectiveTimeoutError | None:
    """If ``error`` is a collective that timed out, a :class:`CollectiveTimeoutError` that names
    the rank(s) that did not arrive (else None). Call it on every rank that got the error.

    gloo's timeout says only that this rank waited. So every rank that timed out writes "I was
    waiting" into the job's store (``MASTER_ADDR:MASTER_PORT``), waits a grace period for the
    others to time out too, and reads who wrote: the ranks that did not are the ones that never
    arrived (a hang, a frozen process). When the store itself does not answer, the rank that
    serves it (rank 0) is the one that is frozen or gone. NCCL aborts the process on its own
    timeout (its watchdog) before Python sees an error; this covers gloo (CPU).
    """
    if not (_initialized() and isinstance(error, RuntimeError) and "Timed out" in str(error)):
        return None
    me, world = dist.get_rank(), dist.get_world_size()
    grace = min(5.0, max(2.0, (timeout_s or 10.0) / 5))  # the others entered the same collective a little later
    at = _where(error, step)
    waited_for = f"{timeout_s:g} s (timeout_s)" if timeout_s is not None else "the process group's timeout"
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:  # a group made without env:// (tcp://)
        return CollectiveTimeoutError(f"rank {me} waited {waited_for} in a collective{at}: another rank did not arrive "
                                      "(hung, frozen or unreachable)")
    waited: list[int] = []

    def ask_store() -> None:
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                                  timedelta(seconds=grace + 2), wait_for_workers=False)
            prefix = f"paratrain/waited/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
            store.set(f"{prefix}{me}", str(step))
            time.sleep(grace)
            waited.extend(r for r in range(world) if store.check([f"{prefix}{r}"]))
        except Exception:  # refused, timed out, gone: `waited` stays empty
            pass

    # In a thread with a deadline: TCPStore's connection check waits without a timeout on a
    # frozen server, and this process must end (the agent then stops the others).
    asking = threading.Thread(target=ask_store, name="paratrain-who-waited", daemon=True)
    asking.start()
    asking.join(grace + 5)
    answered = [] if asking.is_alive() else list(waited)
    if not answered:  # the store did not answer (not even with this rank's own key)
        return CollectiveTimeoutError(
            f"rank {me} waited {waited_for} in a collective{at}, and the job's store on rank 0 does not "
            "answer either: rank 0 is frozen, gone or unreachable")
    missing = [r for r in range(world) if r not in answered]
    if not missing:
        return CollectiveTimeoutError(
            f"every rank waited {waited_for} in a collective{at}: they wait in different collectives "
            f"{_some_ranks_only(error)}")
    hint = f" {_some_ranks_only(error)}" if collective_call(error) is not None else ""
    return CollectiveTimeoutError(
        f"{_ranks(missing)} did not arrive at a collective{at} for {waited_for}: hung, frozen or unreachable; "
        f"{_ranks(answered)} waited for {'them' if len(missing) > 1 else 'it'}{hint}")


# gloo's words (tcp/pair.cc) for a peer whose end of the connection closed: it exited or was killed
_PEER_CLOSED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def explain_peer_loss(error: BaseException, step: int | None = None, grace_s: float = 2.0) -> PeerLostError | None:
    """If ``error`` is a collective whose peer closed its connection, a :class:`PeerLostError`
    saying so in one line (else None), returned after ``grace_s`` seconds.

    The peer ended first: it crashed, or was killed (SIGKILL, the OOM killer). The wait lets the
    launcher see that peer's end before this rank's, so that torchrun's agent reports the rank
    that really failed: with workers started as functions it reports only the first failure it
    sees, and its error files' times would otherwise put this rank's error first.
    """
    if not (_initialized() and isinstance(error, RuntimeError)):
        return None
    cause = next((words for words in _PEER_CLOSED if words in str(error)), None)
    if cause is None:
        return None
    time.sleep(grace_s)
    at = _where(error, step)
    return PeerLostError(f"rank {dist.get_rank()} lost its connection to a peer in a collective{at} ({cause}): another rank "
                         "ended first; its failure is the cause")


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


def _some_ranks_only(error: BaseException) -> str:
    call = collective_call(error)
    if call is None:
        return "(code that runs a collective on some ranks only?)"
    return f"(Parallel.{call} is a collective: does every rank call it, not the main process only?)"


def explain_failure(error: BaseException, step: int | None = None) -> CollectiveTimeoutError | None:
    """:func:`explain_timeout` (with the ``timeout_s`` this process joined with, if paratrain made the group), else
    :func:`explain_peer_loss`: the one-line cause of a failed collective, or None."""
    if isinstance(error, CollectiveTimeoutError):
        return None  # explained already
    return explain_timeout(error, _joined_timeout_s, step) or explain_peer_loss(error, step)


def remember_timeout(timeout_s: float) -> None:
    """Record the ``timeout_s`` of the process group this process joined (``init``), for the lines above."""
    global _joined_timeout_s
    _joined_timeout_s = timeout_s


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def explain_uncaught() -> None:
    """Make an uncaught failed collective end this process with its one-line cause (who did not
    arrive, or which peer ended first), printed after the traceback: for a script's own loop,
    where no paratrain code is on the stack to catch it. Chains to the current ``sys.excepthook``.

    Under torchrun's agent (``paratrain run``, ``torchrun``) the exception, or that cause, is also
    written to the worker's error file as ``@record`` would (unless the script's own ``@record``
    did), so that the launcher's last line names it."""
    previous = sys.excepthook
    if getattr(previous, "_paratrain", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        mark_failed()
        previous(kind, value, tb)
        try:
            why = explain_failure(value)
        except Exception:  # explaining must never hide the error itself
            why = None
        if why is not None:
            print(f"paratrain: {type(why).__name__}: {why}", file=sys.stderr, flush=True)
        _record_for_the_agent(why or value, tb)

    hook._paratrain = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def uncaught_seen() -> bool:
    """Whether this process is ending with an exception: one :func:`explain_uncaught`'s hook saw,
    or one a worker wrapper caught (:func:`mark_failed`)."""
    return _uncaught


def mark_failed() -> None:
    """Record that this process is ending with an error its own code caught (``paratrain.launch``'s
    worker wrapper): at exit it leaves the group without waiting for its peers."""
    global _uncaught
    _uncaught = True


def _record_for_the_agent(error: BaseException, tb: Any) -> None:
    """Write ``error`` to ``TORCHELASTIC_ERROR_FILE`` in the format of torch's
    ``ErrorHandler.record_exception`` (which formats only the exception being handled)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    data = {"message": {"message": f"{type(error).__name__}: {error}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(type(error), error, tb)),
        "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the launcher's line then names no cause; the traceback above still does
        pass


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
