"""paratrain's modules import each other without a cycle (issue 38, item 5): the import graph read
off the source by ``scripts/import_graph.py`` (function-level imports included; not those under
``if TYPE_CHECKING:``, which never run; not a package's ``__init__`` re-exporting its submodules)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import import_graph  # noqa: E402


def test_no_module_of_paratrain_imports_one_that_imports_it_back():
    top, every, local = import_graph.design_graphs()
    assert len(every) > 100 and every["paratrain.parallel"] and local, "the import graph was not read"
    assert import_graph.cycles(every) == []


def test_a_cycle_is_found():
    assert import_graph.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_cli_and_a_ddp_run_do_not_import_dtensor():
    """``torch.distributed.tensor`` costs ~0.7 s of every process's start (sympy): only what builds DTensors imports
    it (paratrain.dtensors asks sys.modules), so `paratrain train --help` and ddp's launcher do not."""
    import subprocess

    code = ("import sys, paratrain, paratrain.cli.main, paratrain.cli.train, paratrain.loop.train, paratrain.bench.memory\n"
            "from paratrain.dtensors import is_dtensor, local_part\n"
            "import torch\n"
            "t = torch.ones(2)\n"
            "assert not is_dtensor(t) and local_part(t) is t\n"
            "print(sorted(m for m in ('torch.distributed.tensor', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_a_dtensor_is_seen_and_its_local_part_taken():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from paratrain.dtensors import is_dtensor, local_part

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Replicate()])
        assert is_dtensor(d) and torch.equal(local_part(d), torch.arange(4.0)) and not is_dtensor(d.to_local())
    finally:
        dist.destroy_process_group()
