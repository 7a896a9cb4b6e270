"""Stopping safely when the cluster asks: a preemption signal ends the run at a step boundary.

Slurm sends SIGTERM, or the signal chosen with ``sbatch --signal`` (often ``USR1@90``), before it
kills a job; Kubernetes and spot instances send SIGTERM with a grace period. Here, per process:

* :class:`StopSignal`'s handler (SIGTERM, SIGUSR1, or the signals ``PARATRAIN_STOP_SIGNALS``
  names) only sets a flag, then calls a handler the program had installed before. Until a loop
  asks (``Parallel.should_stop``), a signal does what it did before: a script that never asks is
  not left running;
* :meth:`StopSignal.check`, called at an optimizer-step boundary, agrees on the flag over every
  rank (one all-reduce MAX of one number per step), so every rank stops at the same step; it then
  saves what was registered (``Parallel.save_on_stop``), prints one line on the main process,
  requeues the Slurm job when the job allows it, and tells the launcher (``PARATRAIN_STOP_REPORT``);
* a deadline: ``PARATRAIN_PREEMPT_GRACE_S`` (default 60 s, ``--preempt-grace-s``) after the signal,
  a process whose checkpoint is not complete ends at once. Checkpoint files are written atomically
  and ``latest`` is replaced last (:mod:`paratrain.checkpoint.io`), so the previous checkpoint
  stays the newest valid one.

A process that received the signal itself exits with :data:`PREEMPTED_EXIT_CODE` (75); one that
learnt of it from a peer exits 0 (its launcher must neither restart it nor report a failure).
paratrain's launcher (``paratrain run``/``train``) has torchrun's agent forward these signals
(``--signals-to-handle``) and wait for the workers (``--shutdown-timeout``: the grace plus 15 s),
then exits 75 itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["PREEMPTED_EXIT_CODE", "StopSignal", "stop_signal", "exit_code", "flag_on_any_rank", "stop_signals", "grace_s", "agent_flags",
           "read_reports", "slurm_requeued", "LauncherSignals"]

PREEMPTED_EXIT_CODE = 75  # sysexits.h's EX_TEMPFAIL: stopped on request, continue later with --resume
GRACE_ENV = "PARATRAIN_PREEMPT_GRACE_S"
SIGNALS_ENV = "PARATRAIN_STOP_SIGNALS"
REPORT_ENV = "PARATRAIN_STOP_REPORT"  # a folder of this node's launcher: each stopped worker leaves a file
REQUEUE_ENV = "PARATRAIN_REQUEUE"  # auto (when Slurm's job allows it), 1 or 0
DEFAULT_GRACE_S = 60.0
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # torchrun's default, and Slurm's usual --signal
_NOT_A_STOP = ("SIGINT", "SIGKILL", "SIGSTOP")  # Ctrl-C stays an interrupt; the others cannot be caught
_AGENT_MARGIN_S = 15


def stop_signals(environ: Any = None) -> list[signal.Signals]:
    """The signals that stop a run at a step boundary: ``PARATRAIN_STOP_SIGNALS`` (comma-separated
    names), default SIGTERM and SIGUSR1; SIGINT (Ctrl-C) stays an interrupt."""
    names = (environ if environ is not None else os.environ).get(SIGNALS_ENV) or ",".join(DEFAULT_SIGNALS)
    found = []
    for name in (n.strip().upper() for n in names.split(",") if n.strip()):
        name = name if name.startswith("SIG") else "SIG" + name
        sig = getattr(signal.Signals, name, None)
        if sig is not None and name not in _NOT_A_STOP:
            found.append(sig)
    return found


def grace_s(environ: Any = None) -> float:
    """Seconds from the signal to the end of the process: ``PARATRAIN_PREEMPT_GRACE_S`` or 60."""
    value = (environ if environ is not None else os.environ).get(GRACE_ENV, "")
    try:
        grace = float(value) if value else DEFAULT_GRACE_S
    except ValueError:
        raise ValueError(f"{GRACE_ENV}={value!r} is not a number of seconds: use e.g. 60") from None
    if not grace > 0:
        raise ValueError(f"{GRACE_ENV}={value!r} must be a positive number of seconds, e.g. 60")
    return grace


def agent_flags(torchrun_args: list[str], report_dir: str) -> list[str]:
    """torchrun flags (and this process's environment for the workers) so that the agent forwards
    the stop signals and waits for the workers to save: ``--signals-to-handle`` with SIGUSR1 added
    to torchrun's default unless given, ``--shutdown-timeout`` the grace plus a margin unless given
    (or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is set)."""
    given = {a.split("=", 1)[0]: a.split("=", 1)[1] if "=" in a else "" for a in torchrun_args}
    flags = []
    handled = given.get("--signals-to-handle")
    if handled is None:
        handled = AGENT_SIGNALS
        flags.append(f"--signals-to-handle={handled}")
    os.environ.setdefault(SIGNALS_ENV, handled if "--signals-to-handle" in given else ",".join(DEFAULT_SIGNALS))
    if "--shutdown-timeout" not in given and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        flags.append(f"--shutdown-timeout={int(grace_s()) + _AGENT_MARGIN_S}")
    os.makedirs(report_dir, exist_ok=True)
    os.environ[REPORT_ENV] = report_dir
    return flags


def read_reports(report_dir: str) -> int | None:
    """The step at which this node's workers stopped on a signal (their reports), or None."""
    try:
        steps = [int(p.read_text() or -1) for p in Path(report_dir).glob("rank-*")]
    except (OSError, ValueError):
        return None
    return max(steps) if steps else None


class LauncherSignals:
    """In the launcher: note in ``report_dir`` each stop signal this process receives, as it arrives
    (Python's wakeup fd, written by the C-level handler whatever Python handler torch's agent has).
    The agent also sends SIGTERM to a group it tears down after a failure; a worker takes a SIGTERM
    for a preemption only when its launcher got one too (:meth:`StopSignal._handle`)."""

    def __init__(self, report_dir: str) -> None:
        self.report_dir, self._fds, self._previous, self._set = report_dir, os.pipe(), -1, False

    def __enter__(self) -> "LauncherSignals":
        if threading.current_thread() is threading.main_thread():
            os.set_blocking(self._fds[1], False)
            self._previous, self._set = signal.set_wakeup_fd(self._fds[1], warn_on_full_buffer=False), True
            threading.Thread(target=self._watch, name="paratrain-launcher-signals", daemon=True).start()
        return self

    def _watch(self) -> None:
        stops = {int(s) for s in stop_signals()}
        while True:
            try:
                got = os.read(self._fds[0], 64)
            except OSError:
                return
            if not got:
                return
            for signum in (n for n in got if n in stops):
                with contextlib.suppress(OSError):
                    Path(self.report_dir, f"signal-{signal.Signals(signum).name}").touch()

    def __exit__(self, *exc: Any) -> None:
        if self._set:
            signal.set_wakeup_fd(self._previous)
        os.close(self._fds[1])  # the watcher reads EOF and ends
        os.close(self._fds[0])


def _launcher_got_it(signum: int) -> bool:
    """Whether this worker's paratrain launcher received ``signum`` as well (waits up to 0.5 s for
    its note): a SIGTERM only from the agent is the teardown of a failed group. True without one."""
    report = os.environ.get(REPORT_ENV)
    if not report or signum != signal.SIGTERM:
        return True
    for _ in range(25):
        if any(Path(report).glob("signal-*")):
            return True
        threading.Event().wait(0.02)
    return False


def slurm_requeued() -> bool:
    """Whether this is a Slurm job that was requeued (``SLURM_RESTART_COUNT`` >= 1): it continues
    from its checkpoint by itself."""
    return os.environ.get("SLURM_RESTART_COUNT", "0").strip() not in ("", "0")


def _requeue() -> str:
    """Requeue this Slurm job when it allows it (``scontrol show job`` says ``Requeue=1``, or
    ``PARATRAIN_REQUEUE=1``); what happened, as the end of the stop line ("" when not Slurm)."""
    job, how = os.environ.get("SLURM_JOB_ID", ""), os.environ.get(REQUEUE_ENV, "auto").strip().lower()
    if not job or how in ("0", "no", "false", "off"):
        return ""
    try:
        if how == "auto":
            shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=20)
            if "Requeue=1" not in shown.stdout.split():
                return f"; Slurm job {job} does not allow requeue (sbatch --requeue)"
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        return f"; Slurm job {job} not requeued: {type(e).__name__}: {e}"
    if done.returncode != 0:
        return f"; Slurm job {job} not requeued: {' '.join(done.stderr.split())[:200]}"
    return f"; Slurm job {job} requeued: it resumes by itself"


_GLOO: list[Any] = []  # the CPU group the flag is agreed over, once made


def flag_on_any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: an all-reduce MAX of one number over the whole job, on
    the CPU (a gloo group beside an NCCL one, made at the first call, which every rank makes at the
    same step), so that asking every step never waits for the accelerator. Without a group: ``flag``."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    if not _GLOO or _GLOO[0][0] is not dist.group.WORLD:  # a new process group: a new side group
        cpu = dist.get_backend() in ("gloo", "mpi")
        _GLOO[:] = [(dist.group.WORLD, None if cpu else dist.new_group(backend="gloo"))]
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_GLOO[0][1])
    return bool(t.item())


class StopSignal:
    """This process's stop flag, set by a signal handler, and the run's stop at a step boundary."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None  # the signal this process got itself
        self.stopped_at: int | None = None  # the step every rank stopped at
        self.polled = False  # a loop asks: from now on a signal stops at a step boundary
        self.main = True
        self._checked = -1
        self._saved = threading.Event()
        self._previous: dict[int, Any] = {}
        self._deadline: threading.Thread | None = None
        self.save: Callable[[], Any] | None = None  # what the run saves when it stops (None: nothing)

    def install(self, main: bool) -> None:
        """Handle the stop signals in this process (main thread only; once), and start a new run."""
        self.main, self.polled, self.stopped_at, self._checked = main, False, None, -1
        self.save, self.received, self._saved, self._deadline = None, None, threading.Event(), None
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in stop_signals():
            if sig not in self._previous:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum)
        if not self.polled or (self.received is None and not _launcher_got_it(signum)):
            # nothing looks at the flag, or the agent ends a failed group: what the signal did before
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if self.received is None:
            self.received = signal.Signals(signum)
            self._start_deadline()
        if callable(previous):  # a handler the program installed itself runs too
            previous(signum, frame)

    def _start_deadline(self) -> None:
        if self._deadline is not None:
            return
        grace = grace_s()

        def wait() -> None:
            if self._saved.wait(grace):
                return
            if self.main:
                step = "" if self.stopped_at is None else f" at step {self.stopped_at}"
                print(f"paratrain: preempted{step}: no checkpoint completed within {grace:g} s of the signal "
                      f"({GRACE_ENV}, --preempt-grace-s); the newest complete checkpoint is kept: continue with "
                      f"--resume{_requeue()}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(128 + int(self.received or signal.SIGTERM))

        self._deadline = threading.Thread(target=wait, name="paratrain-preempt-deadline", daemon=True)
        self._deadline.start()

    def check(self, step: int, micro_step: int, any_rank: Callable[[bool], bool] | None = None) -> bool:
        """Whether the run stops now: at a step boundary (``micro_step`` 0), once per ``step``, every
        rank learns whether any rank got a stop signal (``any_rank``, default :func:`flag_on_any_rank`: a
        collective). On the step they agree on, :attr:`save` (if registered) runs on every rank, then
        the one line."""
        any_rank = any_rank or flag_on_any_rank
        self.polled = True
        if self.stopped_at is not None:
            return True
        if micro_step or step == self._checked:
            return False
        self._checked = step
        if not any_rank(self.received is not None):
            return False
        self.stopped_at = step
        self._start_deadline()  # a rank that learnt it from a peer has the same deadline
        if self.save is not None:
            self.save()
        any_rank(True)  # every rank's part of the checkpoint is written before the job is requeued
        self._saved.set()
        report = os.environ.get(REPORT_ENV)
        if report:
            try:
                Path(report, f"rank-{os.environ.get('RANK', '0')}").write_text(str(step))
            except OSError:
                pass
        if self.main:
            what = "checkpoint saved" if self.save is not None else "nothing registered to save (pt.save_on_stop)"
            print(f"preempted at step {step}: {what}; continue with --resume{_requeue()}", flush=True)
        return True

    @property
    def exit_code(self) -> int:
        """:data:`PREEMPTED_EXIT_CODE` when this process got the signal itself, else 0."""
        return PREEMPTED_EXIT_CODE if self.stopped_at is not None and self.received is not None else 0


_STOP = StopSignal()


def exit_code() -> int:
    """This process's exit code after a run that stopped on a signal (:attr:`StopSignal.exit_code`)."""
    return _STOP.exit_code


def stop_signal(main: bool) -> StopSignal:
    """This process's :class:`StopSignal`, its handlers installed, for a new run."""
    _STOP.install(main)
    return _STOP
