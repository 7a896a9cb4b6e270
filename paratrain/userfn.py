"""Load a user's function named ``module:function`` or ``path/to/file.py:function``.

Used wherever paratrain accepts the user's own code by name: models and datasets
(``--model mypkg.nets:make_net``), and ``paratrain verify --entry``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, Callable

__all__ = ["is_user_spec", "load_callable"]


def is_user_spec(name: str) -> bool:
    """True for ``module:function`` / ``file.py:function`` (but not ``torchvision:<name>``)."""
    target, sep, fn = name.rpartition(":")
    return bool(sep and target and fn) and target != "torchvision"


def load_callable(spec: str, what: str = "--entry") -> Callable[..., Any]:
    """The callable named by ``spec``; ``what`` names the option in error messages."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{what} {spec!r} is not MODULE:FUNCTION or path/to/script.py:FUNCTION")
    if target.endswith(".py") or os.sep in target:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{what} script {target!r} does not exist")
        folder = os.path.dirname(path)
        if folder not in sys.path:  # as `python file.py` does: the file imports its neighbours
            sys.path.insert(0, folder)
        mod_name = "_paratrain_user_" + os.path.splitext(os.path.basename(path))[0]
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader_spec)  # type: ignore[arg-type]
        sys.modules[mod_name] = module
        try:
            loader_spec.loader.exec_module(module)  # type: ignore[union-attr]
        except ModuleNotFoundError as e:
            raise ValueError(f"{what} {spec!r}: {target} imports a module that is not installed or not on the "
                             f"path ({e}); install it or set PYTHONPATH") from None
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise ValueError(f"{what} {spec!r}: cannot import module {target!r} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{what} {spec!r}: {target!r} has no function {name!r}")
    return fn
