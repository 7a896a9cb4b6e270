"""Fault injection for the tests, from outside paratrain: every Python process the tests start
(``clitools.cli_env`` puts this folder on ``PYTHONPATH``) imports this file at startup, and it
patches paratrain only when a ``PARATRAIN_TEST_*`` variable asks for a fault:

* ``PARATRAIN_TEST_KILL_AT=rank:step`` SIGKILLs that rank after that optimizer step,
  ``PARATRAIN_TEST_HANG_AT`` makes it sleep (it stops arriving at collectives),
  ``PARATRAIN_TEST_STOP_AT`` SIGSTOPs it (a frozen process); first attempt only (a restarted
  group trains on), through ``fit``'s ``on_step`` in ``paratrain train``; rank ``*`` is whichever
  rank this process is (set it on one host's launcher: that host's ranks);
* ``PARATRAIN_TEST_WAIT_ALONE_AT=step``: a world of one process waits after that step (for a
  second host to join, which restarts it at a bigger world; a restart at world 1 waits again);
* ``PARATRAIN_TEST_CRASH_AFTER_BYTES=N``: a checkpoint writer dies after N bytes, as a killed
  process would;
* ``PARATRAIN_TEST_SIGNAL_AT=step:SIGNAME``: after that optimizer step (first attempt), rank 0 sends
  the signal to its launcher (``PARATRAIN_AGENT_PID``; itself without one), as Slurm or Kubernetes
  would to the job: a preemption;
* ``PARATRAIN_TEST_SLOW_SAVE_AFTER=step:seconds``: the checkpoint file of a later step, written to
  its temporary name, waits that long before it is renamed (a save that outlasts the preemption
  grace period);
* ``PARATRAIN_TEST_SLOW_STEPS=seconds``: every optimizer step of a Slurm job's first attempt (not
  requeued: no ``SLURM_RESTART_COUNT``) sleeps that long, so that Slurm's ``--signal`` finds it training;
* ``PARATRAIN_TEST_STEP_SLEEP=seconds``: every optimizer step of ``paratrain train`` takes that
  much longer (a run that is still training when a second one starts);
* ``PARATRAIN_TEST_WRONG_STRATEGY=name``: that strategy trains wrongly: on rank 1 the model it
  wraps returns its outputs ×1.5, so that rank's gradients are wrong (a broken all-reduce would do
  the same to the average).
"""

import os
import sys

_FAULTS = ("KILL", "HANG", "STOP")


def _install_step_fault(name: str, spec: str) -> None:
    import signal
    import time

    import paratrain.loop.train as train

    act = {"KILL": lambda: os.kill(os.getpid(), signal.SIGKILL), "HANG": lambda: time.sleep(3600),
           "STOP": lambda: os.kill(os.getpid(), signal.SIGSTOP)}[name]
    who, step = spec.split(":")
    rank, step = (None if who == "*" else int(who)), int(step)
    fit = train.fit

    def faulty_fit(*args, on_step=None, **kwargs):
        def hook(pt):
            if on_step is not None:
                on_step(pt)
            # read when the step ends: workers forked from paratrain's forkserver got this
            # patch before torchrun told them which attempt they are
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if not restarted and rank in (None, pt.rank) and pt.global_step == step:
                act()

        return fit(*args, on_step=hook, **kwargs)

    train.fit = faulty_fit


def _install_write_crash(limit: int) -> None:
    import paratrain.checkpoint.io as io

    class CrashAfter:
        def __init__(self, f):
            self.f, self.left = f, limit

        def write(self, data):
            data = memoryview(data).cast("B")
            if len(data) > self.left:
                self.f.write(data[: self.left])
                self.f.flush()
                os._exit(137)
            self.left -= len(data)
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    write_atomic = io._write_atomic
    io._write_atomic = lambda path, write, *args, **kwargs: write_atomic(path, lambda f: write(CrashAfter(f)), *args,
                                                                         **kwargs)


def _install_wait_alone(step: int) -> None:
    import time

    import paratrain.loop.train as train

    fit = train.fit

    def waiting_fit(*args, on_step=None, **kwargs):
        def hook(pt):
            if on_step is not None:
                on_step(pt)
            while pt.world_size == 1 and pt.global_step == step:
                time.sleep(0.1)

        return fit(*args, on_step=hook, **kwargs)

    train.fit = waiting_fit


def _install_signal_at(spec: str) -> None:
    import signal

    import paratrain.loop.train as train

    step, name = spec.split(":")
    fit = train.fit

    def signalling_fit(*args, on_step=None, **kwargs):
        def hook(pt):
            if on_step is not None:
                on_step(pt)
            first = not int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if first and pt.rank == 0 and pt.global_step == int(step):
                os.kill(int(os.environ.get("PARATRAIN_AGENT_PID") or os.getpid()), getattr(signal, name))

        return fit(*args, on_step=hook, **kwargs)

    train.fit = signalling_fit


def _install_slow_save(spec: str) -> None:
    import re
    import time

    import paratrain.checkpoint.io as io

    after, seconds = spec.split(":")
    write_atomic = io._write_atomic

    def slow(path, write, *args, **kwargs):
        m = re.match(r"step-(\d+)\.pt$", path.name)
        if not (m and int(m.group(1)) > int(after)):
            return write_atomic(path, write, *args, **kwargs)
        return write_atomic(path, lambda f: (write(f), f.flush(), time.sleep(float(seconds))), *args, **kwargs)

    io._write_atomic = slow


def _install_slow_steps(seconds: float) -> None:
    import time

    import paratrain.loop.train as train

    fit = train.fit

    def slow_fit(*args, on_step=None, **kwargs):
        def hook(pt):
            if on_step is not None:
                on_step(pt)
            if os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0"):
                time.sleep(seconds)

        return fit(*args, on_step=hook, **kwargs)

    train.fit = slow_fit


def _install_step_sleep(seconds: float) -> None:
    import time

    import paratrain.loop.train as train

    fit = train.fit

    def slow_fit(*args, on_step=None, **kwargs):
        def hook(pt):
            if on_step is not None:
                on_step(pt)
            time.sleep(seconds)

        return fit(*args, on_step=hook, **kwargs)

    train.fit = slow_fit


def _install_wrong_strategy(name: str) -> None:
    import paratrain.strategies as strategies

    cls = strategies.STRATEGIES[name]
    wrap = cls.wrap

    def wrong_wrap(self, model, *args, **kwargs):
        wrapped = wrap(self, model, *args, **kwargs)
        if int(os.environ.get("RANK", "0")) == 1:
            wrapped.register_forward_hook(lambda module, inputs, output: output * 1.5)
        return wrapped

    cls.wrap = wrong_wrap


def _install_all() -> None:
    if os.environ.get("PARATRAIN_TEST_WRONG_STRATEGY"):
        _install_wrong_strategy(os.environ["PARATRAIN_TEST_WRONG_STRATEGY"])
    if os.environ.get("PARATRAIN_TEST_STEP_SLEEP"):
        _install_step_sleep(float(os.environ["PARATRAIN_TEST_STEP_SLEEP"]))
    if os.environ.get("PARATRAIN_TEST_WAIT_ALONE_AT"):
        _install_wait_alone(int(os.environ["PARATRAIN_TEST_WAIT_ALONE_AT"]))
    for _name in _FAULTS:
        if os.environ.get(f"PARATRAIN_TEST_{_name}_AT"):
            _install_step_fault(_name, os.environ[f"PARATRAIN_TEST_{_name}_AT"])
            break
    if os.environ.get("PARATRAIN_TEST_SIGNAL_AT"):
        _install_signal_at(os.environ["PARATRAIN_TEST_SIGNAL_AT"])
    if os.environ.get("PARATRAIN_TEST_SLOW_SAVE_AFTER"):
        _install_slow_save(os.environ["PARATRAIN_TEST_SLOW_SAVE_AFTER"])
    if os.environ.get("PARATRAIN_TEST_SLOW_STEPS"):
        _install_slow_steps(float(os.environ["PARATRAIN_TEST_SLOW_STEPS"]))
    if os.environ.get("PARATRAIN_TEST_CRASH_AFTER_BYTES"):
        _install_write_crash(int(os.environ["PARATRAIN_TEST_CRASH_AFTER_BYTES"]))


# multiprocessing's resource tracker (a new interpreter each launch starts) runs no paratrain code: it
# imports nothing of it, which would cost it torch's import (seconds of CPU a launch)
if not any("multiprocessing.resource_tracker" in arg for arg in getattr(sys, "orig_argv", ())):
    _install_all()
