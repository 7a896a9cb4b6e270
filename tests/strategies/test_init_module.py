"""Sharded initialisation (issue 28, item 1): ``with pt.init_module():`` builds the model on the meta
device under fsdp, and setup gives each rank only its shards, with exactly the values of the model
built whole with the same seed, at world sizes 1, 2 and 4; a checkpoint loads into it; and a model
whose training state no single worker can hold trains under fsdp at world size 2 when each worker's
memory is capped (a cgroup memory limit), while the same model built whole is stopped by that cap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
import zoo
from parity import assert_same_state

import paratrain
from paratrain.nn.deferred import Recorder, recorded_values

pytestmark = pytest.mark.timeout(300)
SEED = 4


def build(kind: str) -> torch.nn.Module:
    return zoo.GPT(n_layer=3) if kind == "gpt" else zoo.hf_model(kind)


def whole(kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    return {k: v.clone() for k, v in build(kind).state_dict().items()}


def sharded_init(rank: int, kinds: tuple[str, ...]) -> dict[str, object]:
    out: dict[str, object] = {}
    for kind in kinds:
        pt = paratrain.Parallel(strategy="fsdp", seed=SEED)
        with pt.init_module():
            model = build(kind)
        out[f"{kind} on meta"] = all(p.device.type == "meta" for p in model.parameters())
        model = pt.setup(model)
        local = sum(p.to_local().numel() for p in pt.unwrap(model).parameters())
        out[f"{kind} local"] = local
        out[kind] = pt.full_state_dict(model)
        after = torch.randn(3)  # the generator goes on as after a whole build
        out[f"{kind} rng"] = after
    paratrain.Parallel(strategy="fsdp").close()
    return out


def _kinds() -> tuple[str, ...]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ("gpt",)
    return ("gpt", "llama")


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_init_equals_the_whole_build(world):
    kinds = _kinds()
    ranks = paratrain.launch(sharded_init, nprocs=world, args=(kinds,), timeout=240)
    for kind in kinds:
        ref = whole(kind)
        torch.manual_seed(SEED)
        build(kind)
        rng_after = torch.randn(3)
        params = sum(p.numel() for p in build(kind).parameters())
        for r in ranks:
            assert r[f"{kind} on meta"] is True
            assert_same_state(r[kind], ref, rtol=0.0)  # bit for bit
            assert torch.equal(r[f"{kind} rng"], rng_after)
            assert r[f"{kind} local"] <= params // world + 4096  # each rank holds its shards only


def test_world_size_1_builds_whole_on_the_device():
    pt = paratrain.Parallel(strategy="fsdp", seed=SEED)
    with pt.init_module():
        model = build("gpt")
    assert all(p.device == pt.device for p in model.parameters())
    assert_same_state(pt.setup(model).state_dict(), whole("gpt"), rtol=0.0)


def test_what_cannot_be_replayed_is_refused_in_one_line():
    rec = Recorder()
    with rec:
        model = torch.nn.Linear(4, 4)
        with torch.no_grad():
            model.weight[0].zero_()  # written through a view: the weight's own record no longer says it
    with pytest.raises(ValueError, match=r"^init_module cannot rebuild 'weight': it was written through a view"):
        recorded_values(rec, model)


# --- a model no single worker can hold ------------------------------------------------------------
CGROUP = "/sys/fs/cgroup/memory"


def _cap_memory(limit_bytes: int, owner: int) -> None:
    """Move this process into a cgroup of its own that may hold ``limit_bytes`` (cgroup v1 charges a
    moved process's pages to its old group: the cap counts what it allocates from now on)."""
    group = os.path.join(CGROUP, f"paratrain-test-{owner}-{os.getpid()}")
    os.makedirs(group, exist_ok=True)
    with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit_bytes))
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


class Big(torch.nn.Module):
    """24 M parameters: training it whole with AdamW needs 16 bytes each, 384 MB."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(1024, 1024) for _ in range(24)])
        self.head = torch.nn.Linear(1024, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


CAP = 340 * 2**20  # per worker, of what it allocates once capped (measured: 211 MB sharded, 465 MB whole)


def train_capped(rank: int, strategy: str, sharded: bool, owner: int) -> float:
    torch.set_num_threads(1)
    pt = paratrain.Parallel(strategy=strategy, global_batch=8, seed=SEED)
    _cap_memory(CAP, owner)
    if sharded:
        with pt.init_module():
            model = Big()
    else:
        model = Big()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = pt.setup(model, opt)
    x, y = torch.randn(4, 1024), torch.randint(0, 2, (4,))
    for _ in range(2):
        opt.zero_grad()
        pt.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()
    loss = pt.reduce(torch.nn.functional.cross_entropy(model(x), y).detach()).item()
    pt.close()
    return loss


def _cgroup_usable() -> bool:
    probe = os.path.join(CGROUP, f"paratrain-probe-{os.getpid()}")
    try:
        os.makedirs(probe)
        os.rmdir(probe)
        return True
    except OSError:
        return False


def _launch_capped(strategy: str, sharded: bool, nprocs: int) -> subprocess.CompletedProcess:
    """Launch in a fresh interpreter (nothing of this test process's state: its imports, threads and
    heap shape the workers' memory), with glibc's mmap threshold fixed: glibc keeps freed blocks for
    reuse once its threshold grows, and the cgroup would charge memory no tensor holds (read at
    start-up, so it is set for the launcher, whose spawned workers inherit it)."""
    code = ("import os, sys; sys.path[:0] = [os.environ['TESTS'], os.environ['TESTS'] + '/strategies']; "
            "import paratrain, test_init_module as t; "
            f"print(paratrain.launch(t.train_capped, nprocs={nprocs}, args=({strategy!r}, {sharded}, os.getpid()), "
            "timeout=200))")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072", "TESTS": tests,
           "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for name in os.listdir(CGROUP):
            if name.startswith(f"paratrain-test-{proc.pid}-"):
                os.rmdir(os.path.join(CGROUP, name))  # its processes have ended
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.skipif(not _cgroup_usable(), reason="needs root and the cgroup v1 memory controller to cap a worker")
def test_a_model_no_worker_can_hold_trains_sharded():
    assert 16 * sum(p.numel() for p in Big().parameters()) > CAP  # its unsharded training state exceeds the cap
    sharded = _launch_capped("fsdp", True, 2)
    assert sharded.returncode == 0, sharded.stderr[-2000:]
    whole = _launch_capped("single", False, 1)
    assert whole.returncode != 0 and "exited with code -9" in whole.stderr  # the kernel's OOM killer, at the cap
