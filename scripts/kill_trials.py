"""SIGKILL trials (issue 14's sweep): kill a worker at a random moment and check that the job is
restarted and ends with the same weights as an uninterrupted run; kill the torchrun agent and
check that no worker trains on. Preemption trials (issue 26): SIGTERM the launcher at a random
step, check that it exits 75 with a checkpoint of the step in flight, resume it with --resume, and
compare the final weights.

    python scripts/kill_trials.py [--workers 6] [--agents 2] [--preempt 0] [--seed 0]
    python scripts/kill_trials.py --workers 0 --agents 0 --preempt 4     # preemption trials only
    python scripts/kill_trials.py --checkpoint-async                      # checkpoints written in the background

Every trial runs ``paratrain train --strategy ddp --nproc-per-node 2`` on the built-in data, in
its own process group, killed from outside (no hook inside paratrain). Prints one row per trial
and the counts: trials / equal weights / result.json intact / orphans.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS, EVERY = 100, 10
COMMON = ["train", "--strategy", "ddp", "--nproc-per-node", "2", "--model", "cnn", "--epochs", "10", "--max-steps",
          str(STEPS), "--checkpoint-every", str(EVERY), "--no-progress", "--global-batch", "32"]


def start(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "paratrain", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return out


def workers(launcher: int) -> list[int]:
    """The launcher's workers: they fork from the forkserver the agent started (paratrain.launch.forkserver),
    so they are its children's children (its own children are the forkserver and a resource tracker)."""
    return [w for server in children(launcher) for w in children(server)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def final_weights(run: Path) -> dict:
    import torch

    newest = sorted((run / "checkpoints").glob("step-*.pt"))[-1]
    return torch.load(newest, weights_only=True)["model"]


def equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out, err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=6, help="worker-kill trials")
    ap.add_argument("--agents", type=int, default=2, help="agent-kill trials")
    ap.add_argument("--preempt", type=int, default=0, help="preemption trials: SIGTERM at a random step, then --resume")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-async", action="store_true",
                    help="every run writes its checkpoints in the background (a kill may land mid-write)")
    args = ap.parse_args()
    if args.checkpoint_async:
        COMMON.append("--checkpoint-async")
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="paratrain-kill-"))
    start_t = time.monotonic()
    rc, _, err = finish(start([*COMMON, "--log-dir", str(tmp / "ref")]))
    if rc != 0:
        print(f"reference run failed: {err[-2000:]}")
        return 1
    ref, ref_s = final_weights(tmp / "ref"), time.monotonic() - start_t
    print(f"reference: {STEPS} steps in {ref_s:.0f} s")
    same = intact = 0
    for t in range(args.workers):
        run = tmp / f"w{t}"
        proc = start([*COMMON, "--log-dir", str(run), "--max-restarts", "2"])
        after = rng.randrange(0, STEPS - EVERY, EVERY)  # kill after this checkpoint (0: before the first one)...
        began = time.monotonic()
        while time.monotonic() - began < 120 and not (
                (run / "checkpoints" / f"step-{after:08d}.pt").exists() if after else len(workers(proc.pid)) == 2):
            time.sleep(0.05)
        # ...at a random moment of the steps that follow: within the next half checkpoint interval, so
        # that it lands in training, not in a finished run's exit (where torch's agent can hang: see below)
        time.sleep(rng.uniform(0.0, 0.5) * ref_s * EVERY / STEPS)
        delay = time.monotonic() - began
        victims = workers(proc.pid)
        victim = rng.choice(victims) if victims else None
        if victim is not None:
            os.kill(victim, signal.SIGKILL)
        rc, out, err = finish(proc)
        result = json.loads((run / "result.json").read_text()) if (run / "result.json").exists() else {}
        ok_result = rc == 0 and result.get("steps") == STEPS and result.get("test_accuracy") is not None
        ok_weights = rc == 0 and equal(final_weights(run), ref)
        same += ok_weights
        intact += ok_result
        resumed = result.get("resumed_from_step")
        print(f"worker trial {t}: killed pid {victim} {delay:4.1f} s in (after checkpoint {after}) -> exit {rc}, resumed from step {resumed}, "
              f"weights {'equal' if ok_weights else 'DIFFER'}, result.json {'intact' if ok_result else 'BAD'}"
              + ("" if rc == 0 else f": {err.strip().splitlines()[-1:]}"))
    orphans = 0
    for t in range(args.agents):
        run = tmp / f"a{t}"
        proc = start(["train", "--strategy", "ddp", "--nproc-per-node", "2", "--epochs", "1000", "--checkpoint-every",
                      "4", "--no-progress", "--log-dir", str(run)])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (run / "checkpoints" / "latest").exists():
            time.sleep(0.2)  # the first checkpoint: the workers train (the folder itself is made at the start)
        ranks = workers(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        time.sleep(10)
        left = [w for w in ranks if alive(w)]
        orphans += len(left)
        print(f"agent trial {t}: agent killed with {len(ranks)} workers; {len(left)} still alive 10 s later")
        finish(proc, timeout=5)
    print(f"\nworker kills: {args.workers} trials, {same} with weights equal to the uninterrupted run, "
          f"{intact} with result.json intact; agent kills: {args.agents} trials, {orphans} orphaned workers")
    if args.preempt:
        preempt_trials(args.preempt, rng, tmp, ref)
    return 0


def last_logged_step(run: Path) -> int:
    """The newest step in train.csv (logged every step, by rank 0 after the step)."""
    try:
        header, *rows = (run / "train.csv").read_text().splitlines()
        col = header.split(",").index("step")
        return max(int(float(row.split(",")[col])) for row in rows if row.count(",") >= col) if rows else 0
    except (OSError, ValueError):
        return 0


def preempt_trials(n: int, rng: random.Random, tmp: Path, ref: dict) -> None:
    """SIGTERM the launcher (as Slurm or Kubernetes do) once a random step was logged: it must exit 75
    with a checkpoint at the step in flight (0 steps lost beyond it); --resume must finish the run
    (result.json intact) with the uninterrupted run's weights."""
    same = intact = lost_total = 0
    for t in range(n):
        run = tmp / f"p{t}"
        proc = start([*COMMON, "--log-dir", str(run), "--set", "log_every=1"])
        at = rng.randrange(1, STEPS - 5)
        began = time.monotonic()
        while time.monotonic() - began < 180 and last_logged_step(run) < at and proc.poll() is None:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))  # a random moment of the steps that follow
        done = last_logged_step(run)  # steps finished (and logged) before the signal
        os.kill(proc.pid, signal.SIGTERM)
        rc, out, err = finish(proc)
        line = next((ln for ln in out.splitlines() if ln.startswith("preempted at step")), "")
        said = int(line.split()[3].rstrip(":")) if line else -1
        newest = sorted((run / "checkpoints").glob("step-*.pt"))
        kept = int(newest[-1].stem.split("-")[1]) if newest else 0
        lost = max(0, done - kept) + (kept != said)  # the line names the checkpoint it wrote
        lost_total += lost
        rc2, _, err2 = finish(start([*COMMON, "--resume", str(run)]))
        result = json.loads((run / "result.json").read_text()) if (run / "result.json").exists() else {}
        ok_result = rc2 == 0 and result.get("steps") == STEPS and result.get("test_accuracy") is not None
        ok_weights = rc2 == 0 and equal(final_weights(run), ref)
        same += ok_weights
        intact += ok_result
        print(f"preempt trial {t}: SIGTERM after step {done} -> exit {rc}, '{line}', checkpoint {kept}, "
              f"{lost} steps lost; resumed -> exit {rc2}, weights {'equal' if ok_weights else 'DIFFER'}, "
              f"result.json {'intact' if ok_result else 'BAD'}" + ("" if rc2 == 0 else f": {err2.strip().splitlines()[-1:]}")
              + ("" if rc == 75 else f" (launcher: {err.strip().splitlines()[-1:]})"))
    print(f"preemptions: {n} trials, {same} with weights equal to the uninterrupted run, {intact} with result.json "
          f"intact, {lost_total} steps lost beyond the one in flight")


if __name__ == "__main__":
    sys.exit(main())
