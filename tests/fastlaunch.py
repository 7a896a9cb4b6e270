"""``paratrain.launch`` for the test suite: workers fork from a server that has imported torch
(``start_method="forkserver"``), instead of each starting python and importing torch (seconds of
CPU per worker on a 2-core machine, for ~100 launches). Each launch still gets new processes.

A forkserver's children inherit the server's environment, not the test's: :func:`_in_callers_env`
gives each worker the environment the test had when it launched (``monkeypatch.setenv`` included),
plus what ``launch`` sets. A test that needs a fresh interpreter passes ``start_method="spawn"``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import paratrain
from pace import scaled
from paratrain.launch import spawn

PRELOAD = ("torch", "paratrain.bench.worker", "torch.distributed.pipelining",
           *(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "gpt2", "bert")))
"""What the tests' forkserver imports once, for every worker it forks: torch, bench's worker, pipelining (half a
second), and the modules of the tiny HuggingFace models (``zoo.hf_model``: transformers' modeling code imports
torchao too, about 3 s of CPU in every worker that builds one). The forkserver skips a module that is missing."""

_LAUNCH_KEYS = {"WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "RANK",
                "LOCAL_RANK", "GROUP_RANK", "PARATRAIN_SPAWNED", "PARATRAIN_AGENT_PID", "PARATRAIN_TRACE_DIR"}


def _in_callers_env(local_rank: int, fn: Callable[..., Any], callers_env: dict[str, str], extra: Sequence[str],
                    *args: Any) -> Any:
    keep = {k: os.environ[k] for k in _LAUNCH_KEYS | set(extra) if k in os.environ}
    os.environ.clear()
    os.environ.update({k: v for k, v in callers_env.items() if not k.startswith(spawn._INHERITED)})
    os.environ.update(keep)
    return fn(local_rank, *args)


def launch(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), **kwargs: Any) -> list[Any]:
    if kwargs.get("timeout") is not None:  # a test's hard limit, with this machine's room (tests/pace.py)
        kwargs["timeout"] = scaled(kwargs["timeout"])
    if kwargs.setdefault("start_method", "forkserver") != "forkserver":
        return spawn.launch(fn, nprocs, args, **kwargs)
    # The preload is read once, when the session's server starts: whoever starts it gets bench's too.
    kwargs["preload"] = tuple(dict.fromkeys((*PRELOAD, *kwargs.get("preload", ()))))
    extra = tuple((kwargs.get("env") or {}).keys())
    return spawn.launch(_in_callers_env, nprocs, (fn, dict(os.environ), extra, *args), **kwargs)


def install() -> None:
    """Make ``paratrain.launch`` this function for the whole test session."""
    paratrain.launch = launch  # type: ignore[assignment]
