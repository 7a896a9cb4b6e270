"""The lab's own commands: hosts reach each other by name, ``cut``/``heal`` take a link down and
up, ``net`` shapes the links, ``down`` leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clitools import ROOT

SERVER = "import socket; s = socket.create_server(('0.0.0.0', 29516)); print('up', flush=True); s.accept()"
CLIENT = "import socket; socket.create_connection(('pt-h1', 29516), timeout=2); print('connected')"


def lab_cli(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "scripts.lab", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def connects(lab) -> bool:
    server = subprocess.Popen(lab.exec_argv(1, [sys.executable, "-c", SERVER]), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        return lab_cli("exec", "pt-h0", "--", sys.executable, "-c", CLIENT).stdout.strip() == "connected"
    finally:
        server.kill()
        server.wait()


@pytest.mark.timeout(60)
def test_cut_heal_and_net(fresh_lab):
    lab = fresh_lab
    assert lab_cli("status").stdout.split() == ["pt-h0", "10.77.0.10", "pt-h1", "10.77.0.11", "pt-h2", "10.77.0.12"]
    assert connects(lab)
    assert lab_cli("cut", "pt-h1").returncode == 0
    assert not connects(lab)
    assert lab_cli("heal", "h1").returncode == 0
    assert connects(lab)
    assert lab_cli("net", "--rate", "100mbit").returncode == 0
    assert "tbf" in subprocess.run(["tc", "qdisc", "show", "dev", "pt-v1"], capture_output=True, text=True).stdout
    assert "rate 100Mbit" in subprocess.run(lab.exec_argv(1, ["tc", "qdisc", "show", "dev", "eth0"]),
                                            capture_output=True, text=True).stdout
    assert connects(lab)
    bad = lab_cli("cut", "node7")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
