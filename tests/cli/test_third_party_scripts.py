"""``paratrain run`` launches what users already have, unchanged: a HuggingFace ``Trainer`` script, a
Lightning ``Trainer(strategy="ddp")`` script and an Accelerate loop each train as 2 processes (each
framework finds the world torchrun's variables describe) and end with the same weights on both
ranks, which only a working gradient all-reduce gives.

On the CPU build of torch 2.13 a worker of such a script is sometimes aborted as it exits, after
training, by gloo's threads ("terminate called without an active exception", SIGABRT): here 1 run in
4 to 8 of the Accelerate and Lightning scripts, under plain torchrun just as under paratrain run, and
whether or not the script destroys its process group. That exit, and only that one, is accepted
after both ranks have reported (docs/launching.md says so)."""

from __future__ import annotations

import re

import pytest

from clitools import ROOT, run_cli

SCRIPTS = ROOT / "tests" / "scripts" / "third_party"


@pytest.mark.parametrize("script, package", [
    ("hf_trainer.py", "transformers"),
    ("lightning_fit.py", "lightning"),
    ("accelerate_loop.py", "accelerate"),
])
def test_paratrain_run_launches_another_frameworks_script_unchanged(script, package, tmp_path):
    pytest.importorskip(package)
    r = run_cli(["run", "--nproc-per-node", "2", str(SCRIPTS / script), str(tmp_path / "out")], timeout=180,
                cwd=tmp_path)
    exit_abort = "terminate called without an active exception" in r.stderr and r.returncode == 134
    assert r.returncode == 0 or exit_abort, r.stdout[-2000:] + r.stderr[-3000:]
    ranks = {int(m[0]): (int(m[1]), m[2]) for m in re.findall(r"RANK (\d) WORLD (\d) CHECKSUM (-?\d\.\d+e[+-]\d+)", r.stdout)}
    assert sorted(ranks) == [0, 1], r.stdout[-2000:]
    assert {world for world, _ in ranks.values()} == {2}
    assert ranks[0][1] == ranks[1][1], ranks  # DDP kept the replicas equal
