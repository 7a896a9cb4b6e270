"""A failed collective that nobody caught ends the process with its one-line cause (:mod:`.failures`), and the
process remembers that it is failing: at its exit it waits for no peer (``env.process``), and its trackers close
the run as failed."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from .failures import explain_failure, speaks

__all__ = ["explain_uncaught", "uncaught_seen", "mark_failed"]

_uncaught = False  # an uncaught exception reached explain_uncaught's hook: the process is failing


def explain_uncaught() -> None:
    """Make an uncaught failed collective end this process with its one-line cause (who did not
    arrive, or which peer ended first) instead of gloo's traceback: for a script's own loop,
    where no paratrain code is on the stack to catch it. Any other exception is this rank's own
    and keeps its traceback. Chains to the current ``sys.excepthook`` (one the script installed
    also sees an explained failure).

    Under torchrun's agent (``paratrain run``, ``torchrun``) the exception, or that cause, is also
    written to the worker's error file as ``@record`` would (unless the script's own ``@record``
    did), so that the launcher's last line names it."""
    previous = sys.excepthook
    if getattr(previous, "_paratrain", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        mark_failed()
        try:
            why = explain_failure(value)
        except Exception:  # explaining must never hide the error itself
            why = None
        if why is None or not _prints_only(previous):  # this rank's own error: its traceback
            previous(kind, value, tb)
        if why is not None and speaks(why):  # a consequence (a peer ended, a rank did not arrive): one line
            print(f"paratrain: {type(why).__name__}: {why}", file=sys.stderr, flush=True)
        _record_for_the_agent(why or value, tb)

    hook._paratrain = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _prints_only(hook: Any) -> bool:
    """Whether ``hook`` only prints the traceback: Python's own, or the one ``init_process_group``
    wraps around it to prefix each line with ``[rank N]:`` (a script's own hook does more)."""
    return hook is sys.__excepthook__ or getattr(hook, "__qualname__", "").endswith("._distributed_excepthook")


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
