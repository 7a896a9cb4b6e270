"""A host that drops off the network mid-run: every surviving rank ends within ``timeout_s`` + 6 s and its
exit with one line that names the rank that was lost, and no process is left in any lab host."""

from __future__ import annotations

import time

import pytest

from labrun import finish_all, start
from pace import scaled
from paratrain.env.failures import _grace
from paratrain.env.heartbeat import silent_after

TIMEOUT_S = 10


def wait_for_steps(path, steps, procs, timeout=90):
    """Until rank 0 has logged ``steps`` lines to ``path`` (train.jsonl), or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a host exited before step {steps}: {[p.poll() for p in procs]}")
        time.sleep(0.2)
    raise AssertionError(f"no step {steps} in {timeout}s")


@pytest.mark.timeout(200)
def test_cut_link_fails_fast_and_names_the_lost_rank(fresh_lab, tmp_path):
    lab = fresh_lab
    args = ["train", "--strategy", "ddp", "--max-steps", "100000", "--epochs", "100000", "--no-progress",
            "--set", f"parallel.timeout_s={TIMEOUT_S}", "--set", "log_every=1", "--backend", "gloo",
            "--nnodes", "2", "--master-addr", lab.addr(0), "--master-port", "29513", "--nproc-per-node", "1"]
    procs = [start(lab, k, [*args, "--node-rank", str(k), "--log-dir", str(tmp_path / f"h{k}")]) for k in range(2)]
    wait_for_steps(tmp_path / "h0" / "train.jsonl", 5, procs)
    lab.cut(1)
    t0 = time.monotonic()
    results = finish_all(procs, TIMEOUT_S + 60)
    took = time.monotonic() - t0
    # the product's terms: host 1 waits timeout_s, then asks rank 0's store (grace + 2 s to connect: explain_timeout);
    # host 0 waits timeout_s and the grace, or the heartbeat's silence when it waited in Parallel.evaluate. Then an
    # allowance for the launchers' exits, with the machine's room (tests/pace.py)
    promise = TIMEOUT_S + max(2 * _grace(TIMEOUT_S) + 2, _grace(TIMEOUT_S) + silent_after(TIMEOUT_S))
    assert took <= promise + scaled(6), f"the ranks took {took:.1f}s after the cut (timeout_s={TIMEOUT_S})"
    h0, h1 = (r.stderr.strip().splitlines()[-1] for r in results)
    print(f"ended {took:.1f}s after the cut:\n{h0}\n{h1}")
    assert results[0].returncode != 0 and results[1].returncode != 0
    # host 0 serves the store: the ranks that waited wrote there, rank 1 never did
    assert h0.startswith("paratrain train: error: rank 1 did not arrive at a collective"), h0
    # host 1 reaches nobody: it names rank 0, whose store does not answer
    assert h1.startswith("paratrain train: error: rank 1 waited") and "rank 0 is frozen, gone or unreachable" in h1, h1
    for ns in lab.hosts():
        assert lab.pids(ns) == [], f"processes left in {ns}"
