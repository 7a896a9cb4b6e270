"""What ``paratrain run``/``train`` say when torchrun's workers fail: one line naming the rank that
caused it (not the ranks that merely lost it), and one line per restart of the worker group, read
off torch's own ``ChildFailedError`` and the elastic agent's monitoring result."""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Any, Callable, Iterator

from ..env.failures import is_consequence

__all__ = ["failure_line", "one_line", "restart_lines"]

PREFIX = "paratrain run: error:"  # the default; paratrain train passes its own
_NOT_AVAILABLE = "<N/A>"  # ProcessFailure.error_file when the worker wrote no error file


def one_line(text: Any) -> str:
    """First non-empty line of ``text`` (an exception's ``Type: message``), trimmed."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _message(failure: Any) -> str:
    """The first line of what a failed worker recorded (``Type: message``), "" without an error file."""
    if failure.error_file == _NOT_AVAILABLE:
        return ""
    message = failure.message
    if isinstance(message, dict):  # {"message": "Type: msg", "extraInfo": {...}}
        message = message.get("message", "")
    return one_line(message)


def _culprits(err: Any) -> list[int]:
    """The ranks whose failure is the cause, the first one first.

    Not a rank that only lost its peer (:func:`~paratrain.env.failures.is_consequence`), nor one
    ended by SIGTERM without a recorded error: that is the agent stopping the group once a worker
    failed (torch records those ``for bookkeeping``). The first is torch's own order (the error
    file's time, then the order the agent saw the failures); only where every failure is such a
    consequence is it named (an outside SIGTERM)."""
    failures = dict(err.failures)
    order = {rank: k for k, rank in enumerate(failures)}  # the order the agent saw them in

    def consequence(failure: Any) -> bool:
        message = _message(failure)
        return is_consequence(message) if message else failure.exitcode == -signal.SIGTERM

    causes = [rank for rank, failure in failures.items() if not consequence(failure)]
    first = min(causes or failures, key=lambda rank: (failures[rank].timestamp, order[rank]))
    return [first, *sorted(rank for rank in causes if rank != first)]


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def failure_line(err: Any, prefix: str = PREFIX, records: Any = None,
                 log_of: Callable[[int], str] | None = None) -> tuple[str, int]:
    """One line and an exit code for a ``ChildFailedError``: the rank that failed first, with its
    recorded error, and no rank that merely lost it (:func:`_culprits`). ``records``: each rank's
    record of its collectives (:func:`paratrain.trace.recorder.read_dir`): where the ranks went
    different ways, that is the cause, and the line says it (:func:`paratrain.trace.analyze.cause`).
    ``log_of(rank)``: the file that keeps a rank's output, named at the end of the line."""
    line, rc = _failure_line(err, prefix, records)
    if log_of is not None:
        line += f" (output: {log_of(_culprits(err)[0])})"
    return line, rc


def _failure_line(err: Any, prefix: str, records: Any) -> tuple[str, int]:
    culprits = _culprits(err)
    rank, failure = culprits[0], err.failures[culprits[0]]
    who = f"rank {rank}" if len(culprits) == 1 else f"ranks {', '.join(map(str, sorted(culprits)))} (first: rank {rank})"
    code = int(failure.exitcode)
    root = _message(failure)  # the worker recorded its exception (``@record``, or paratrain's excepthook)
    if code == -signal.SIGTERM and root:  # the agent stopped it on its way out (its exit handlers, a busy machine)
        code = 1  # after it recorded its error: that error ended it, as Python's exit status says
    if code < 0:  # killed by a signal: report like a shell does
        how, rc = f"killed by {_signal_name(-code)}", 128 - code
    else:
        how, rc = f"exit code {code}", code or 1
    kind, sep, text = root.partition(": ")
    said = None if kind == "CollectiveTimeoutError" else _records_say(records, rank, root)  # it compared them
    if said is not None and said[1]:  # the ranks went different ways: that is the cause, whoever ended first
        return f"{prefix} {said[0]} (worker rank {rank} {how.replace('exit code', 'exited with code')})", rc
    if sep and kind in ("CollectiveTimeoutError", "CollectiveMismatchError"):  # it names the ranks: that is the news
        return f"{prefix} {text}", rc
    if said is not None:
        root = f"{root}; {said[0]}" if root else said[0]
    if sep and code == 2 and kind.isidentifier():  # a paratrain one-line error: its text, as in one process
        root = text
    return f"{prefix} worker {who} failed ({how})" + (f": {root}" if root else ""), rc


def _records_say(records: Any, rank: int, message: str) -> tuple[str, bool] | None:
    if not records:
        return None
    from ..trace.analyze import cause

    try:
        return cause(records, rank, message)
    except Exception:  # noqa: BLE001 - records the analysis cannot read must not hide the failure itself
        return None


def _restart_line(result: Any, restart: int, max_restarts: int, resumes_from: Callable[[], int | None] | None) -> str:
    """``worker rank 1 died (SIGKILL); restart 1/2 from the checkpoint at step 40``: the agent's
    failed round (``result``: its ``RunResult``) and the restart it begins."""
    rank = _culprits(result)[0]
    failure = result.failures[rank]
    code, root = int(failure.exitcode), _message(failure)
    what = f"died ({_signal_name(-code)})" if code < 0 else f"failed (exit code {code}{': ' + root if root else ''})"
    line = f"worker rank {rank} {what}; restart {restart}/{max_restarts}"
    step = resumes_from() if resumes_from is not None else None
    if resumes_from is not None:
        line += f" from the checkpoint at step {step}" if step is not None else " from step 0 (no checkpoint yet)"
    return line


@contextlib.contextmanager
def restart_lines(resumes_from: Callable[[], int | None] | None = None) -> Iterator[None]:
    """Print one line each time torchrun's agent restarts the worker group after a failure
    (:func:`_restart_line`), read off the agent's own monitoring: the ``RunResult`` of
    ``LocalElasticAgent._monitor_workers`` (its failures) and its remaining restarts, just before
    the agent acts on them. ``resumes_from``: where the restarted workers continue (the built-in
    job's checkpoint folder); without it the line names no step."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def monitored(agent: Any, worker_group: Any) -> Any:
        result = monitor(agent, worker_group)
        remaining = getattr(agent, "_remaining_restarts", 0)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and remaining > 0 and result.failures:
            with contextlib.suppress(Exception):  # saying it must never stop the restart
                most = worker_group.spec.max_restarts
                print(f"paratrain: {_restart_line(result, most - remaining + 1, most, resumes_from)}",
                      file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = monitored  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
