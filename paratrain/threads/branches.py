"""``fork``/``wait``/``fork_map``: branches on paratrain's thread pool, or on torch's inter-op pool
through a scripted launcher for TorchScript functions (the package's docstring says what overlaps)."""

from __future__ import annotations

import builtins
import contextlib
import functools
import re
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence, cast

import torch
from torch import nn

__all__ = ["fork", "wait", "fork_map", "BACKENDS"]

BACKENDS = ("auto", "threads", "jit", "sequential")
_MAX_JIT_ARGS = 4
_NOT_COMPILED_REASON = ("paratrain runs branches on threads, outside the compiled graph: compile the branch "
                        "functions and fork those")


def _NOT_COMPILED(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)``, applied when the function is first called with
    ``torch._dynamo`` loaded: disabling at import would import ``torch._dynamo`` (seconds) in every
    process, and without it nothing can be compiling."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled.append(torch.compiler.disable(fn, reason=_NOT_COMPILED_REASON))
        return disabled[0](*args, **kwargs)

    return call


# --- thread-local state carried into a branch ----------------------------------------------------

def _autocast_device_types() -> tuple[str, ...]:
    types = ["cpu", "cuda"]
    acc = getattr(torch, "accelerator", None)
    current = acc.current_accelerator() if acc is not None and hasattr(acc, "current_accelerator") else None
    if current is not None and current.type not in types:
        types.append(current.type)
    return tuple(types)


_AUTOCAST_TYPES = _autocast_device_types()


@dataclass(frozen=True)
class _State:
    """The caller's thread-local torch state that a branch must see to compute what the caller would."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of every enabled autocast
    autocast_cache: bool
    cuda: tuple[int, Any] | None  # (current device, current stream) once CUDA is initialised

    @classmethod
    def capture(cls) -> _State:
        autocast = tuple((t, torch.get_autocast_dtype(t)) for t in _AUTOCAST_TYPES if torch.is_autocast_enabled(t))
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = (torch.cuda.current_device(), torch.cuda.current_stream())
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast,
                   torch.is_autocast_cache_enabled(), cuda)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache))
            if self.cuda is not None:
                stack.enter_context(torch.cuda.device(self.cuda[0]))
                stack.enter_context(torch.cuda.stream(self.cuda[1]))
            yield


# --- the thread pool -----------------------------------------------------------------------------

class _Task:
    """One branch: runs once, in a pool thread or in whichever thread waits for it first."""

    __slots__ = ("fn", "args", "kwargs", "state", "future", "_claimed", "_lock")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, future: torch.futures.Future) -> None:
        self.fn: Callable[..., Any] | None = fn
        self.args, self.kwargs = args, kwargs
        self.state = _State.capture()
        self.future = future
        self._claimed = False
        self._lock = threading.Lock()

    def claim(self) -> bool:
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def run(self) -> None:
        # Drop the references once taken: a finished branch must not keep its inputs alive.
        fn, args, kwargs, self.fn, self.args, self.kwargs = self.fn, self.args, self.kwargs, None, (), {}
        assert fn is not None, "a branch runs once"
        try:
            with self.state.applied():
                result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits, with its type
            self.future.set_exception(e)
        else:
            self.future.set_result(result)


def _run_task(task: _Task) -> None:
    if task.claim():
        task.run()


def _init_worker() -> None:
    # A new thread's first parallel region sets its OpenMP/MKL thread count to torch's intra-op
    # setting (at::init_num_threads). A thread that never asks runs MKL with its own default: here
    # a 512x512 matmul loop took 3-4x the CPU time in such a thread than in the main one.
    torch.get_num_threads()


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """paratrain's branch threads: as many as torch's inter-op threads (read each time, so that
    ``torch.set_num_interop_threads``/``configure_threads`` after the first fork still count)."""
    global _pool, _pool_size
    size = torch.get_num_interop_threads()
    with _pool_lock:
        if _pool is None or _pool_size != size:
            if _pool is not None:
                _pool.shutdown(wait=False)  # its queued tasks still run; new ones go to the new pool
            _pool = ThreadPoolExecutor(size, thread_name_prefix="paratrain-fork", initializer=_init_worker)
            _pool_size = size
        return _pool


def _reset_pool() -> None:
    """New threads on the next fork (they read the intra-op setting when they start)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is not None:
            _pool.shutdown(wait=False)
        _pool, _pool_size = None, 0


class _ForkFuture(torch.futures.Future):
    """A ``torch.futures.Future`` that knows its task, so that ``wait`` can run a branch no thread
    has picked up yet."""

    _task: _Task | None = None


def _fork_thread(fn: Callable[..., Any], args: tuple, kwargs: dict) -> torch.futures.Future:
    fut = _ForkFuture()
    task = _Task(fn, args, kwargs, fut)
    fut._task = task
    _executor().submit(_run_task, task)
    return fut


# --- TorchScript forks ---------------------------------------------------------------------------

def _is_script(fn: Any) -> bool:
    return isinstance(fn, (torch.jit.ScriptFunction, torch.jit.ScriptModule))


def _jit_eligible(fn: Any, args: tuple, kwargs: dict) -> bool:
    return (_is_script(fn) and not kwargs and 1 <= len(args) <= _MAX_JIT_ARGS
            and all(isinstance(a, torch.Tensor) for a in args))


# Launchers: TorchScript that forks. The fork must be *inside* TorchScript to run asynchronously.
# Unannotated arguments are Tensors in TorchScript; the return type (a Future of whatever the
# function returns) is inferred.
class _Launch1(nn.Module):
    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, a):
        return torch.jit.fork(self.fn, a)


class _Launch2(_Launch1):
    def forward(self, a, b):  # type: ignore[override]
        return torch.jit.fork(self.fn, a, b)


class _Launch3(_Launch1):
    def forward(self, a, b, c):  # type: ignore[override]
        return torch.jit.fork(self.fn, a, b, c)


class _Launch4(_Launch1):
    def forward(self, a, b, c, d):  # type: ignore[override]
        return torch.jit.fork(self.fn, a, b, c, d)


def _function_launcher(fn: Any, n: int) -> Any:
    # A ScriptFunction cannot be a submodule: the launcher finds it in its closure instead.
    def launch1(a):
        return torch.jit.fork(fn, a)

    def launch2(a, b):
        return torch.jit.fork(fn, a, b)

    def launch3(a, b, c):
        return torch.jit.fork(fn, a, b, c)

    def launch4(a, b, c, d):
        return torch.jit.fork(fn, a, b, c, d)

    return torch.jit.script((launch1, launch2, launch3, launch4)[n - 1])


_MODULE_LAUNCHERS = (_Launch1, _Launch2, _Launch3, _Launch4)
# A module's launchers live on the module (a cycle the garbage collector frees with it); a
# ScriptFunction takes neither attributes nor weak references, so its launchers stay here.
_function_launchers: dict[int, tuple[Any, dict[int, Any]]] = {}
_launcher_lock = threading.Lock()


def _launcher(fn: Any, n: int) -> Any | None:
    """The scripted launcher of ``fn`` with ``n`` tensor arguments (built once), or None when
    TorchScript cannot compile one (then the thread pool runs ``fn``)."""
    with _launcher_lock:
        if isinstance(fn, torch.jit.ScriptModule):
            table = fn.__dict__.setdefault("_paratrain_launchers", {})
        else:
            table = _function_launchers.setdefault(id(fn), (fn, {}))[1]
        if n not in table:
            try:
                with warnings.catch_warnings():
                    # torch deprecates TorchScript (2.13: DeprecationWarning, 2.14: FutureWarning); the
                    # user scripted fn already, the launcher is paratrain's own
                    warnings.simplefilter("ignore", DeprecationWarning)
                    warnings.simplefilter("ignore", FutureWarning)
                    if isinstance(fn, torch.jit.ScriptModule):
                        table[n] = torch.jit.script(_MODULE_LAUNCHERS[n - 1](fn))
                    else:
                        table[n] = _function_launcher(fn, n)
            except Exception:  # noqa: BLE001 - e.g. non-tensor parameters: the thread pool is the fallback
                table[n] = None
        return table[n]


def _fork_jit(fn: Any, args: tuple) -> torch._C.Future | None:
    launch = _launcher(fn, len(args))
    if launch is None:
        return None
    try:
        return launch(*args)
    except RuntimeError:  # argument types the function does not take: let the pool call it (and raise)
        return None


# --- public API ----------------------------------------------------------------------------------

@_NOT_COMPILED
def fork(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> torch._C.Future:
    """Start ``fn(*args, **kwargs)`` concurrently with the caller; ``wait`` returns its result.

    A TorchScript function or module called with 1-4 tensor arguments runs on torch's inter-op
    pool through a scripted ``torch.jit.fork`` (its future is a ``torch._C.Future``, the base class
    of ``torch.futures.Future``); anything else runs on paratrain's thread pool (a
    ``torch.futures.Future``). The caller's grad mode, inference mode,
    autocast and CUDA device/stream apply in the branch.
    """
    if _jit_eligible(fn, args, kwargs):
        fut = _fork_jit(fn, args)
        if fut is not None:
            return fut
    return _fork_thread(fn, args, kwargs)


@_NOT_COMPILED
def wait(fut: Any) -> Any:
    """The result of a ``fork`` (a ``torch.futures.Future``, a TorchScript fork's ``torch._C.Future``,
    or a ``concurrent.futures.Future``); raises the branch's exception. A branch that no thread has
    started yet runs here."""
    task = getattr(fut, "_task", None)
    if isinstance(task, _Task) and task.claim():
        task.run()
    if not isinstance(fut, torch._C.Future):  # torch.futures.Future and what a TorchScript fork returns
        return fut.result()
    if isinstance(fut, _ForkFuture):
        return fut.wait()
    try:
        return fut.wait()
    except RuntimeError as e:
        raise _builtin_error(e) from e


_SCRIPT_ERROR = re.compile(r"\nbuiltins\.(\w+): (.*)$", re.S)


def _builtin_error(e: RuntimeError) -> BaseException:
    """TorchScript reports a raised ``ValueError("x")`` as a RuntimeError ending in
    ``builtins.ValueError: x``: the built-in exception again, or ``e`` itself."""
    m = _SCRIPT_ERROR.search(str(e))
    cls = getattr(builtins, m.group(1), None) if m else None
    if m and isinstance(cls, type) and issubclass(cls, Exception) and cls is not RuntimeError:
        return cls(m.group(2))
    return e


@_NOT_COMPILED
def fork_map(fn: Callable[[Any], Any] | Sequence[Callable[[Any], Any]], inputs: Iterable[Any],
             *, backend: str = "auto") -> list[Any]:
    """``[fn(x) for x in inputs]`` with the calls running concurrently: the first in the calling
    thread, the others forked. ``fn`` may also be a list of functions, one per input (towers,
    experts). ``backend``: ``auto`` (TorchScript forks for scripted functions with tensor inputs,
    the thread pool otherwise), ``threads``, ``jit`` (scripted functions only) or ``sequential``
    (one after another in the caller: the reference). Every branch has finished when it returns;
    the exception of the first failing branch (in input order) is raised."""
    if backend not in BACKENDS:
        raise ValueError(f"fork_map backend {backend!r}: use one of {', '.join(BACKENDS)}")
    items = list(inputs)
    fns: list[Callable[[Any], Any]] = (list(fn) if isinstance(fn, (list, tuple, nn.ModuleList))
                                       else [cast(Callable[[Any], Any], fn)] * len(items))
    if len(fns) != len(items):
        raise ValueError(f"fork_map: {len(fns)} functions for {len(items)} inputs: give one function per input")
    if backend == "sequential" or len(items) <= 1:
        return [f(x) for f, x in zip(fns, items)]
    if backend == "jit":
        bad = [type(f).__name__ for f, x in zip(fns, items) if not _jit_eligible(f, (x,), {})]
        if bad:
            raise ValueError(f"fork_map backend 'jit' needs TorchScript functions (torch.jit.script) and tensor "
                             f"inputs; got {bad[0]}: use backend 'threads' or 'auto'")
    futures: list[Any] = []
    for f, x in zip(fns[1:], items[1:]):
        fut = _fork_jit(f, (x,)) if backend != "threads" and _jit_eligible(f, (x,), {}) else None
        futures.append(fut if fut is not None else _fork_thread(f, (x,), {}))
    outcomes: list[tuple[bool, Any]] = []
    try:
        outcomes.append((True, fns[0](items[0])))
    except Exception as e:  # noqa: BLE001 - the other branches still finish before it is raised
        outcomes.append((False, e))
    for fut in futures:
        try:
            outcomes.append((True, wait(fut)))
        except Exception as e:  # noqa: BLE001
            outcomes.append((False, e))
    for ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, value in outcomes]
