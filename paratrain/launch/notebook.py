"""``paratrain.launch`` from Jupyter/IPython: a function defined in the notebook runs in forked workers.

``spawn`` and ``forkserver`` send the function to each worker *by reference* (its module and name),
and a new interpreter cannot import an interactive session's ``__main__`` (a notebook, the IPython
or plain REPL, ``python -c``): the workers failed with ``Can't get attribute 'fn' on <module
'__main__'>``. So when what the workers run refers to such a ``__main__``, they are forked from
this process instead (as Accelerate's ``notebook_launcher`` does) and inherit the function as it
is. Forking is safe on the CPU and while CUDA is not initialised in this process; once it is, a
forked worker cannot use CUDA, and :func:`check_fork_safe` says so in one line. A forked worker
runs one intra-op thread (see :func:`paratrain.launch`): GNU OpenMP's threads do not survive a fork,
and a parallel op with more threads hangs in a process forked after its parent ran one.
"""

from __future__ import annotations

import pickle
import sys
import types
from typing import Any, Callable

import torch

__all__ = ["interactive_main", "needs_fork", "check_fork_safe"]



def interactive_main() -> bool:
    """Whether this process's ``__main__`` is one a new interpreter cannot import: IPython/Jupyter
    (``get_ipython()`` answers), or a ``__main__`` without a file (the REPL, ``python -c``, a script
    read from standard input: ``python - <<EOF``, whose ``__file__`` is ``<stdin>``)."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    if main is not None and (file is None or (file.startswith("<") and file.endswith(">"))):
        return True
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    return callable(get_ipython) and get_ipython() is not None


class _RefersToMain(Exception):
    pass


class _Sink:
    def write(self, data: bytes) -> int:  # the pickle itself is not needed, only whether it can be made
        return len(data)


class _MainFinder(pickle.Pickler):
    """Pickles to nowhere, stopping at the first function or class of ``__main__`` (by reference:
    a new interpreter cannot resolve it). Tensors and arrays are not walked: they never refer to
    ``__main__``, and pickling their data would only cost time."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            raise _RefersToMain
        kind = type(obj)
        if (kind.__module__.startswith("torch") and kind.__name__ in ("Tensor", "Parameter")) or (
                kind.__module__ == "numpy" and kind.__name__ == "ndarray"):
            return (int, ())
        return NotImplemented


def needs_fork(fn: Callable[..., Any], args: tuple) -> bool:
    """Whether ``fn(rank, *args)`` must run in forked workers: this is an interactive session and
    ``fn`` or ``args`` refer to its ``__main__`` (or cannot be pickled at all: a lambda, a closure)."""
    if not interactive_main():
        return False
    try:
        _MainFinder(_Sink(), protocol=pickle.HIGHEST_PROTOCOL).dump((fn, args))
    except _RefersToMain:
        return True
    except Exception:  # noqa: BLE001 - unpicklable: spawn would fail too, fork inherits it as it is
        return True
    return False


def check_fork_safe(fn: Callable[..., Any], error: type[Exception]) -> None:
    """Raise ``error`` in one line when forked workers could not work: CUDA is initialised here."""
    if torch.cuda.is_initialized():
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise error(
            f"CUDA has been initialised in this process before paratrain.launch: {name} is defined in this notebook "
            "(an interactive session, which a new process cannot import), so its workers are forked from this "
            "process, and a forked process cannot use CUDA once its parent initialised it; restart the kernel and "
            f"call paratrain.launch before anything touches CUDA, or move {name} into a .py file and import it")
