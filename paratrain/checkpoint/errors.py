"""The one error every checkpoint problem becomes: a single line naming the file and the cause."""

from __future__ import annotations

import pickle
import re

__all__ = ["CheckpointError", "load_error"]

_GLOBAL = re.compile(r"\bGLOBAL ([A-Za-z_][\w.]*)")
_ADVICE = ("weights_only", "Weights only", "Please file an issue", "Check the documentation")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, truncated, corrupt, failing its digest, or
    holding pickled code."""


def load_error(what: str, e: BaseException) -> CheckpointError:
    """``e``, raised by ``torch.load(weights_only=True)`` on ``what``, as one line.

    Torch's own message is long and advises re-running with ``weights_only=False``, which would
    run whatever the file holds: only the cause is kept."""
    msg = str(e)
    if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in msg:
        if m := _GLOBAL.search(msg):
            return CheckpointError(f"{what} is refused: it references {m.group(1)}, which is neither a tensor nor "
                                   "plain data (a checkpoint could run code through it)")
        return CheckpointError(f"{what} is refused by the weights-only loader ({_cause(msg)}): it is corrupt, "
                               "or holds more than tensors and plain data")
    first = _cause(msg)
    return CheckpointError(f"{what} is truncated or corrupt: {type(e).__name__}" + (f": {first}" if first else ""))


def _cause(msg: str) -> str:
    """The first line of torch's message that is neither its advice nor boilerplate."""
    for line in msg.splitlines():
        line = line.split("WeightsUnpickler error:")[-1].strip()
        if line and not any(a in line for a in _ADVICE):
            return line.split(". ")[0]  # the first sentence: miniz goes on for four more
    return ""
