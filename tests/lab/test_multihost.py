"""Several hosts for real: ``paratrain run --nnodes N`` in N network namespaces of the lab trains
the same parameters as one plain-PyTorch process, and gloo talks over the lab's interface."""

from __future__ import annotations

import pytest
import torch

from clitools import ROOT
from labrun import finish_all, start
from parity import assert_same_state

SCRIPT = str(ROOT / "tests" / "scripts" / "lab_train.py")


def check_result(out, nnodes, lab, host=0):
    """``out`` (rank 0's file, written on lab host ``host``) holds the reference's parameters."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lab_train", SCRIPT)
    lab_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab_train)
    got = torch.load(out)
    assert got["world_size"] == nnodes
    assert got["gloo_ifname"] == lab.IFACE
    # rank 0's connections (store client, one gloo pair per peer) all leave from its lab address
    assert got["tcp_local_addresses"] == [lab.addr(host)], got["tcp_local_addresses"]
    p = lab_train.PROBLEM
    assert_same_state(got["state"], p.reference().state, p.rtol)


@pytest.mark.timeout(150)
def test_two_hosts_static_rendezvous_train_like_one_process(fresh_lab, tmp_path):
    lab = fresh_lab
    procs = [start(lab, k, ["run", "--nnodes", "2", "--node-rank", str(k), "--master-addr", lab.addr(0),
                            "--master-port", "29511", "--nproc-per-node", "1", SCRIPT, str(tmp_path / f"out{k}.pt")])
             for k in range(2)]
    for r in finish_all(procs, 120):
        assert r.returncode == 0, r.stderr[-3000:]
    check_result(tmp_path / "out0.pt", 2, lab)


@pytest.mark.timeout(150)
def test_three_hosts_c10d_rendezvous_train_like_one_process(fresh_lab, tmp_path):
    lab = fresh_lab
    endpoint = f"{lab.name(0)}:29512"  # by name: the lab's hosts files resolve it
    procs = [start(lab, k, ["run", "--nnodes", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                            "--rdzv-id", "lab-c10d", "--nproc-per-node", "1", SCRIPT, str(tmp_path / f"out{k}.pt")])
             for k in range(3)]
    for r in finish_all(procs, 120):
        assert r.returncode == 0, r.stderr[-3000:]
    # c10d assigns node ranks on arrival: rank 0 is on whichever host arrived first
    outs = [tmp_path / f"out{k}.pt" for k in range(3) if (tmp_path / f"out{k}.pt").exists()]
    assert len(outs) == 1
    check_result(outs[0], 3, lab, host=int(outs[0].stem[3:]))
