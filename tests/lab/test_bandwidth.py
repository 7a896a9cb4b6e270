"""Bandwidth matters as predicted: on two lab hosts, ddp's step time grows by the bytes per step that
``paratrain bench`` reports divided by the link's rate.

The model is the MLP on CIFAR-shaped synthetic data (1.6 M parameters, 6.3 MB of gradients per
step), so at 100 Mbit/s the all-reduce takes about 0.5 s and the compute about 10 ms: the change
in step time is the network's. A ring all-reduce over N workers sends 2(N-1)/N of the payload
each way on every link; at N = 2 that is the payload itself.
"""

from __future__ import annotations

import json

import pytest

from clitools import run_cli
from labrun import finish_all, start

RATE = "100mbit"
RATE_BYTES_PER_S = 100e6 / 8
JOB = ["--model", "mlp", "--dataset", "synthetic", "--global-batch", "64"]
STEPS = 12


def step_time(lab, tmp_path, tag: str) -> float:
    """Mean step time of ``paratrain train`` (ddp, one process on each of 2 hosts, static rendezvous)."""
    procs = [start(lab, k, ["train", *JOB, "--strategy", "ddp", "--max-steps", str(STEPS), "--epochs", "100",
                            "--no-progress", "--nnodes", "2", "--node-rank", str(k), "--master-addr", lab.addr(0),
                            "--master-port", "29517", "--nproc-per-node", "1",
                            "--log-dir", str(tmp_path / f"{tag}{k}")])
             for k in range(2)]
    for r in finish_all(procs, 150):
        assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / f"{tag}0" / "result.json").read_text())["step_time_s"]


@pytest.mark.timeout(300)
def test_the_bytes_bench_reports_over_the_rate_account_for_the_slower_steps(fresh_lab, tmp_path):
    lab = fresh_lab
    # the bytes of one step, whatever the epoch's length: 8 steps of the synthetic set, not 64
    r = run_cli(["bench", *JOB, "--set", "data.synthetic_size=512", "--strategies", "ddp", "--world-sizes", "2", "--precisions", "32",
                 "--comm-hooks", "none", "--epochs", "1", "--no-baseline", "--no-trap", "--no-progress",
                 "--out", str(tmp_path / "bench")], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    (cell,) = [c for c in json.loads((tmp_path / "bench" / "results.json").read_text())["cells"] if c["status"] == "ok"]
    payload = cell["comm_bytes_per_step"]
    wire = 2 * (2 - 1) / 2 * payload  # ring all-reduce, 2 workers

    unlimited = step_time(lab, tmp_path, "free")
    lab.net(rate=RATE)
    limited = step_time(lab, tmp_path, "slow")
    predicted = wire / RATE_BYTES_PER_S
    measured = limited - unlimited
    print(f"bench: {payload / 2**20:.2f} MiB/step; step {unlimited * 1e3:.0f} ms unlimited, {limited * 1e3:.0f} ms at "
          f"{RATE}: +{measured * 1e3:.0f} ms measured, +{predicted * 1e3:.0f} ms predicted "
          f"({100 * (measured - predicted) / predicted:+.1f}%)")
    assert measured == pytest.approx(predicted, rel=0.25)
