"""paratrain.env.heartbeat in one process: a rank that beats is alive to a watcher, one that stopped is silent."""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from paratrain.env import heartbeat
from paratrain.env.network import free_port


def test_a_beating_rank_is_alive_and_a_stopped_one_is_silent(monkeypatch):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # rank 0 here is not the store's server
    assert heartbeat.interval(10) == 0.5 and heartbeat.interval(600) == 5.0 and heartbeat.silent_after(10) == 2.0
    heartbeat.start(0, 2, 10)
    try:
        alive = heartbeat.Watch(10)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and 0 not in alive.moved:
            alive.look(server, [0, 1])  # rank 1 never beat: unknown, never silent
            time.sleep(0.1)
        assert alive.moved == {0}
    finally:
        heartbeat.stop()
    gone = heartbeat.Watch(10)
    gone.look(server, [0, 1])
    assert gone.silent([0, 1]) == []  # not watched long enough to say
    gone.since -= heartbeat.silent_after(10)  # as if watched that long
    gone.look(server, [0, 1])
    assert gone.silent([0, 1]) == [0]
