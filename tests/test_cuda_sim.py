"""paratrain's CUDA paths, exercised on a machine without a GPU by simulating one.

Users install PyPI's default torch wheel, a CUDA build. These tests replace torch's device queries
(``torch.cuda.is_available``/``device_count``/``set_device``..., ``torch.accelerator.*``) so that
this process looks like it runs on

* ``one_gpu`` / ``two_gpus``: a machine with one or two CUDA devices, or
* ``cuda_no_gpu``: a CUDA build of torch on a machine without a GPU (``current_accelerator()`` is
  ``cuda`` but nothing is available: the CUDA wheel's real situation on a CPU-only machine),

and replace what would touch a GPU (``set_device``, ``init_process_group``, the DDP, DataParallel
and FSDP2 constructors, the device mesh, GradScaler, autocast, ``Module.to('cuda')``, the CUDA RNG)
with recorders. No CUDA kernel runs; no process group is created. The tests pass on torch's CPU
build and on its CUDA wheel; one of them (``test_the_cuda_wheel_without_gpu_really_is_cuda_no_gpu``)
checks the ``cuda_no_gpu`` simulation against the real CUDA wheel, and is skipped on the CPU build.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.distributed.device_mesh
import torch.distributed.fsdp
import torch.distributed.pipelining
import torch.distributed.tensor.parallel
from torch import nn

from paratrain.env import process
from paratrain.env.base import ProcessInfo
from paratrain.env.devices import available_accelerator, select_backend, select_device
from paratrain.env.process import Dist
import paratrain.precision as precision_lib

pytestmark = pytest.mark.smoke  # also run on PyPI's CUDA wheel (scripts/test.sh)

CPU = torch.device("cpu")


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


# --- the simulated machine ----------------------------------------------------------------------

class SimCuda:
    """A simulated machine with ``count`` CUDA devices (0: a CUDA build without a GPU), and what
    paratrain asked of it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.current = 0
        self.set_device: list[torch.device] = []
        self.moved: list[tuple[nn.Module, torch.device]] = []  # Module.to(<cuda>) calls, see fake_to


def _index(device: Any, current: int) -> int:
    """The device index meant by ``device`` (an int, 'cuda', 'cuda:1', torch.device)."""
    if isinstance(device, int):
        return device
    device = torch.device(device)
    assert device.type == "cuda", f"a CUDA call got {device}"
    return current if device.index is None else device.index


def _simulate(monkeypatch: pytest.MonkeyPatch, count: int) -> SimCuda:
    sim = SimCuda(count)
    has = count > 0

    def set_device(device: Any) -> None:
        assert has, f"torch.cuda.set_device({device}) on a machine without a GPU"
        index = _index(device, sim.current)
        assert 0 <= index < count, f"torch.cuda.set_device({device}) but there are {count} GPU(s)"
        sim.set_device.append(cuda(index))
        sim.current = index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: has)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: sim.current)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Simulated GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: has)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: has)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: torch.device("cuda") if has or not check_available else None)
    return sim


@pytest.fixture
def one_gpu(monkeypatch):
    return _simulate(monkeypatch, 1)


@pytest.fixture
def two_gpus(monkeypatch):
    return _simulate(monkeypatch, 2)


@pytest.fixture
def cuda_no_gpu(monkeypatch):
    return _simulate(monkeypatch, 0)


@pytest.fixture(autouse=True)
def clean_env():
    """No launcher variables from outside, and none of init's os.environ.setdefault left behind."""
    saved = os.environ.copy()
    for k in list(os.environ):
        if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES") or k.startswith(("SLURM_", "OMPI_", "TORCHELASTIC_")):
            del os.environ[k]
    yield
    os.environ.clear()
    os.environ.update(saved)


def launched_as(rank: int, world: int, local_rank: int, local_world: int | None = None) -> None:
    """The environment torchrun / paratrain.launch give a process."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_world or world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")


@pytest.fixture
def fake_to(monkeypatch):
    """``Module.to(<a cuda device>)`` is recorded (on the simulated machine) and moves nothing;
    every other ``to`` is torch's own."""
    real = nn.Module.to
    moved: list[tuple[nn.Module, torch.device]] = []

    def to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and device.type == "cuda":
            moved.append((self, device))
            return self
        return real(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", to)
    return moved


@pytest.fixture
def fake_group(monkeypatch):
    """``dist.init_process_group`` records its arguments and creates nothing."""
    calls: list[dict[str, Any]] = []

    def init_process_group(*args, **kwargs):
        assert not args, "paratrain passes init_process_group's arguments by name"
        calls.append(kwargs)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: calls[-1]["backend"])
    monkeypatch.setattr(process, "preload_dynamo", lambda: None)  # not needed without a real group
    # The loopback TCPStore would wait for the other (simulated) rank: record what it would serve.
    monkeypatch.setattr(process, "loopback_store", lambda host, port, rank, world, timeout: ("store", host, port))
    return calls


def recorder(name: str = "Recorder") -> type:
    """A class standing in for a torch wrapper (DDP, DataParallel...): keeps its arguments."""

    class Recorder(nn.Module):
        made: ClassVar[list[Recorder]] = []

        def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
            super().__init__()
            self.module, self.args, self.kwargs, self.hooks = module, args, kwargs, []
            Recorder.made.append(self)

        def register_comm_hook(self, state: Any, hook: Any) -> None:
            self.hooks.append(hook)

    Recorder.__name__ = Recorder.__qualname__ = name
    Recorder.made = []
    return Recorder


@pytest.fixture
def fake_ddp(monkeypatch):
    import paratrain.strategies.ddp as ddp_module

    rec = recorder("DDP")
    monkeypatch.setattr(ddp_module, "DDP", rec)
    return rec


@pytest.fixture
def fake_dp(monkeypatch):
    rec = recorder("DataParallel")
    monkeypatch.setattr(nn, "DataParallel", rec)
    return rec


def dist_info(device: torch.device, rank: int = 0, world: int = 1, local_rank: int | None = None) -> Dist:
    backend = None if world == 1 else ("nccl" if device.type == "cuda" else "gloo")
    local = rank if local_rank is None else local_rank
    return Dist(ProcessInfo(rank=rank, world_size=world, local_rank=local, local_world_size=world), device, backend)


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


# --- device and backend choice --------------------------------------------------------------------

def test_the_simulation_is_complete(two_gpus):
    assert available_accelerator() == ("cuda", 2)
    assert torch.cuda.is_available() and torch.accelerator.is_available()


def test_select_device_one_gpu(one_gpu):
    assert select_device(0) == cuda(0)
    assert select_device(1) == cuda(0)  # local rank modulo the visible GPUs (one GPU per task under Slurm)
    assert select_device(0, "cuda") == cuda(0)
    assert select_device(0, "cpu") == CPU


def test_select_device_two_gpus(two_gpus):
    assert [select_device(r) for r in range(4)] == [cuda(0), cuda(1), cuda(0), cuda(1)]
    assert select_device(1, "cuda") == cuda(1)
    assert select_device(1, "cpu") == CPU
    with pytest.raises(RuntimeError, match="'xpu' was asked for but this machine has cuda") as e:
        select_device(0, "xpu")
    assert "\n" not in str(e.value)


def test_select_device_cuda_build_without_gpu(cuda_no_gpu):
    assert torch.accelerator.current_accelerator() == torch.device("cuda")
    assert available_accelerator() is None
    assert select_device(0) == CPU and select_device(3) == CPU
    with pytest.raises(RuntimeError, match="'cuda' was asked for but this machine has none: use cpu") as e:
        select_device(0, "cuda")
    assert "\n" not in str(e.value)


def test_select_backend():
    assert select_backend(cuda(1)) == "nccl"
    assert select_backend(cuda(0), "auto") == "nccl"
    assert select_backend(cuda(0), "gloo") == "gloo"
    assert select_backend(CPU) == "gloo"
    with pytest.raises(RuntimeError, match="backend 'nccl' needs CUDA devices, but this process runs on cpu") as e:
        select_backend(CPU, "nccl")
    assert "\n" not in str(e.value)


@pytest.mark.skipif(torch.version.cuda is None, reason="needs torch's CUDA build (the PyPI default wheel)")
def test_the_cuda_wheel_without_gpu_really_is_cuda_no_gpu():
    """No simulation: what the CUDA wheel says on this machine is what ``cuda_no_gpu`` pretends."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert torch.accelerator.current_accelerator() == torch.device("cuda")
    assert not torch.accelerator.is_available()
    assert available_accelerator() is None
    assert select_device(0) == CPU
    with pytest.raises(RuntimeError, match="has none"):
        select_device(0, "cuda")


# --- process.init ------------------------------------------------------------------------------------

def test_init_world_of_one_on_gpu_1(two_gpus, fake_group):
    """Local rank 1 of a 2-GPU machine, alone in its world: before 70b8616 an UnboundLocalError."""
    launched_as(rank=0, world=1, local_rank=1)
    d = process.init()
    assert d.device == cuda(1) and d.backend is None
    assert two_gpus.set_device == [cuda(1)]
    assert fake_group == []  # a world of one creates no process group


def test_init_world_of_one_one_gpu(one_gpu, fake_group):
    launched_as(rank=0, world=1, local_rank=1)
    d = process.init()
    assert d.device == cuda(0) and one_gpu.set_device == [cuda(0)]


@pytest.mark.parametrize("rank", [0, 1])
def test_init_world_of_two_uses_nccl_bound_to_the_device(two_gpus, fake_group, rank):
    launched_as(rank=rank, world=2, local_rank=rank)
    d = process.init(timeout_s=42)
    assert two_gpus.set_device == [cuda(rank)]
    (kwargs,) = fake_group
    assert kwargs["backend"] == "nccl" and kwargs["device_id"] == cuda(rank)
    assert kwargs["rank"] == rank and kwargs["world_size"] == 2 and kwargs["store"] == ("store", "127.0.0.1", 29999)
    assert kwargs["timeout"].total_seconds() == 42
    assert d.device == cuda(rank) and d.backend == "nccl" and d.rank == rank
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # a gloo-only setting


def test_init_on_gpus_with_accelerator_cpu(two_gpus, fake_group):
    launched_as(rank=1, world=2, local_rank=1)
    d = process.init(accelerator="cpu")
    assert d.device == CPU and d.backend == "gloo" and two_gpus.set_device == []
    (kwargs,) = fake_group
    assert kwargs["backend"] == "gloo" and "device_id" not in kwargs


def test_init_on_gpus_backend_nccl_requested(two_gpus, fake_group):
    launched_as(rank=1, world=2, local_rank=1)
    assert process.init(backend="nccl").device == cuda(1)
    assert fake_group[0]["backend"] == "nccl"


def test_init_cuda_build_without_gpu(cuda_no_gpu, fake_group):
    launched_as(rank=1, world=2, local_rank=1)
    d = process.init()
    assert d.device == CPU and d.backend == "gloo" and cuda_no_gpu.set_device == []
    (kwargs,) = fake_group
    assert kwargs["backend"] == "gloo" and "device_id" not in kwargs
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_init_cuda_build_without_gpu_refuses_cuda_and_nccl(cuda_no_gpu, fake_group):
    launched_as(rank=0, world=2, local_rank=0)
    with pytest.raises(RuntimeError, match="'cuda' was asked for but this machine has none"):
        process.init(accelerator="cuda")
    with pytest.raises(RuntimeError, match="backend 'nccl' needs CUDA devices"):
        process.init(backend="nccl")
    assert fake_group == []


# --- Parallel, end to end up to the first kernel ---------------------------------------------------

def test_parallel_on_gpu_1(two_gpus, fake_group, fake_to):
    import paratrain

    launched_as(rank=0, world=1, local_rank=1)
    pt = paratrain.Parallel(strategy="single", precision="fp16-mixed", global_batch=8)
    assert pt.device == cuda(1) and two_gpus.set_device == [cuda(1)]
    assert pt.precision.scaler is not None and pt.precision.scaler.is_enabled()  # not disabled as "no CUDA"
    net = mlp()
    model, _ = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert fake_to == [(net, cuda(1))]
    assert pt.unwrap(model) is net


def test_parallel_dp_bf16_on_two_gpus(two_gpus, fake_group, fake_to, fake_dp):
    """Parallel tells the strategy its precision before setup: dp's replicas get bf16 autocast."""
    import paratrain
    from paratrain.strategies.dp import ReplicaAutocast

    pt = paratrain.Parallel(strategy="dp", precision="bf16-mixed", global_batch=8)
    net = mlp()
    model = pt.setup(net)
    assert pt.device == cuda(0) and fake_to == [(net, cuda(0))]
    (dp,) = fake_dp.made
    assert dp.kwargs["device_ids"] == [0, 1] and isinstance(dp.module, ReplicaAutocast)
    assert dp.module.module is net and dp.module.dtype == torch.bfloat16
    assert pt.unwrap(model) is net and pt.strategy.unwrap(model._forward_module) is net and model.module is net


def test_parallel_accelerator_cuda_on_cuda_build_without_gpu(cuda_no_gpu, fake_group):
    import paratrain

    with pytest.raises(RuntimeError, match="'cuda' was asked for but this machine has none: use cpu"):
        paratrain.Parallel(strategy="single", global_batch=8, accelerator="cuda")
    pt = paratrain.Parallel(strategy="single", global_batch=8)
    assert pt.device == CPU


# --- strategies --------------------------------------------------------------------------------------

def test_ddp_on_cuda_passes_the_device(two_gpus, fake_ddp):
    from paratrain.strategies.ddp import DDPOptions, DDPStrategy

    net = mlp()
    s = DDPStrategy(dist_info(cuda(1), rank=1, world=2), options=DDPOptions(comm_hook="fp16"))
    wrapped = s.wrap(net)
    assert isinstance(wrapped, fake_ddp) and wrapped.module is net
    assert wrapped.kwargs["device_ids"] == [1]
    assert len(wrapped.hooks) == 1
    s.set_gradient_sync(wrapped, False)
    assert wrapped.require_backward_grad_sync is False


def test_ddp_setup_model_moves_to_the_device(two_gpus, fake_ddp, fake_to):
    from paratrain.strategies.ddp import DDPStrategy

    net = mlp()
    DDPStrategy(dist_info(cuda(1), rank=1, world=2)).setup_model(net)
    assert fake_to == [(net, cuda(1))]
    assert fake_ddp.made[0].kwargs["device_ids"] == [1]


def test_ddp_on_cpu_has_no_device_ids(cuda_no_gpu, fake_ddp):
    from paratrain.strategies.ddp import DDPStrategy

    wrapped = DDPStrategy(dist_info(CPU, rank=1, world=2)).wrap(mlp())
    assert wrapped.kwargs["device_ids"] is None


def test_ddp_world_of_one_does_not_wrap(one_gpu, fake_ddp):
    from paratrain.strategies.ddp import DDPStrategy

    net = mlp()
    assert DDPStrategy(dist_info(cuda(0))).wrap(net) is net and fake_ddp.made == []


@pytest.mark.parametrize("precision, dtype", [("32", None), ("bf16-mixed", torch.bfloat16),
                                              ("fp16-mixed", torch.float16), ("bf16-true", torch.bfloat16)])
def test_dp_wraps_over_every_gpu(two_gpus, fake_dp, precision, dtype):
    from paratrain.strategies.dp import DataParallelStrategy, ReplicaAutocast

    net = mlp()
    s = DataParallelStrategy(dist_info(cuda(0)))
    s.precision = precision_lib.build(precision, cuda(0))  # what Parallel builds it with
    wrapped = s.wrap(net)
    assert isinstance(wrapped, fake_dp)
    assert wrapped.kwargs["device_ids"] == [0, 1]  # the model's device (cuda:0) first
    inner = wrapped.module
    if dtype is None:
        assert inner is net
    else:
        assert isinstance(inner, ReplicaAutocast) and inner.module is net
        assert inner.device_type == "cuda" and inner.dtype == dtype
    assert s.unwrap(wrapped) is net


def test_dp_puts_the_process_device_first(two_gpus, fake_dp):
    from paratrain.strategies.dp import DataParallelStrategy

    assert DataParallelStrategy(dist_info(cuda(1), local_rank=1)).wrap(mlp()).kwargs["device_ids"] == [1, 0]


@pytest.mark.parametrize("sim", ["one_gpu", "cuda_no_gpu"])
def test_dp_with_fewer_than_two_gpus_is_the_plain_module(request, fake_dp, sim):
    from paratrain.strategies.dp import DataParallelStrategy

    request.getfixturevalue(sim)
    net = mlp()
    device = cuda(0) if sim == "one_gpu" else CPU
    with pytest.warns(UserWarning, match="DataParallel would change nothing"):
        assert DataParallelStrategy(dist_info(device)).wrap(net) is net
    assert fake_dp.made == []


@pytest.fixture
def threads_as_gpus(monkeypatch):
    """Just enough of torch.accelerator for torch's own parallel_apply (DataParallel's forward) to run
    its replicas in threads, on CPU tensors: no streams, no device switching."""
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.accelerator, "device_index", lambda device: contextlib.nullcontext())


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16),
                                              ("fp16-mixed", torch.float16)])
def test_dp_replicas_compute_in_the_precision_dtype(two_gpus, fake_dp, threads_as_gpus, precision, dtype):
    """DataParallel runs each replica in a thread; autocast's dtype is per thread and defaults to
    float16 on CUDA, and parallel_apply passes on only whether autocast is on. Before dp wrapped
    the module in ReplicaAutocast, bf16-mixed replicas computed in float16."""
    from torch.nn.parallel import parallel_apply

    import paratrain.precision as precision_lib
    from paratrain.strategies.dp import DataParallelStrategy

    seen: list[tuple[bool, torch.dtype]] = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append((torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")))
            return x

    s = DataParallelStrategy(dist_info(cuda(0)))
    s.precision = precision_lib.build(precision, cuda(0))
    replica = s.wrap(Probe()).module  # what DataParallel replicates onto each GPU
    with precision_lib.build(precision, cuda(0)).forward_context():  # what ParallelModule.forward enters
        assert torch.get_autocast_dtype("cuda") == dtype
        parallel_apply([replica, replica], [(torch.ones(1),), (torch.ones(1),)], devices=[0, 1])
    assert seen == [(True, dtype), (True, dtype)]
    seen.clear()
    parallel_apply([replica, replica], [(torch.ones(1),), (torch.ones(1),)], devices=[0, 1])
    assert [enabled for enabled, _ in seen] == [False, False]  # no autocast where the loop has none (eval in 32)


def test_autocast_dtype_is_per_thread(two_gpus):
    """The torch behaviour behind the dp fix, so that a torch that starts passing the dtype on is noticed."""
    out = {}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        def replica():
            with torch.autocast("cuda", enabled=True):  # what parallel_apply enters in each thread
                out["dtype"] = torch.get_autocast_dtype("cuda")

        t = threading.Thread(target=replica)
        t.start()
        t.join()
    assert out["dtype"] == torch.float16


class FakeMesh:
    def __init__(self, device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
        self.device_type, self.shape, self.names = device_type, shape, names

    def __getitem__(self, name: str) -> FakeMesh:
        i = self.names.index(name)
        return FakeMesh(self.device_type, (self.shape[i],), (name,))


@pytest.fixture
def fake_mesh(monkeypatch):
    meshes: list[FakeMesh] = []

    def init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None):
        meshes.append(FakeMesh(device_type, tuple(mesh_shape), tuple(mesh_dim_names)))
        return meshes[-1]

    monkeypatch.setattr(torch.distributed.device_mesh, "init_device_mesh", init_device_mesh)
    return meshes


@pytest.fixture
def fake_fully_shard(monkeypatch):
    calls: list[tuple[nn.Module, dict[str, Any]]] = []

    def fully_shard(module, **kwargs):
        calls.append((module, kwargs))
        return module

    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard", fully_shard)
    return calls


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_fsdp_mesh_is_cuda(two_gpus, fake_mesh, fake_fully_shard, capsys, precision):
    from paratrain.strategies.fsdp import FSDPStrategy

    net = mlp()
    s = FSDPStrategy(dist_info(cuda(1), rank=1, world=2))
    s.precision = precision_lib.build(precision, cuda(0))
    assert s.wrap(net) is net
    (mesh,) = fake_mesh
    assert (mesh.device_type, mesh.shape, mesh.names) == ("cuda", (2,), ("dp",))
    assert fake_fully_shard[-1][0] is net  # the root last
    assert len(fake_fully_shard) == 4 and all(kw["mesh"] is mesh for _, kw in fake_fully_shard)
    want = torch.bfloat16 if precision == "bf16-mixed" else None
    assert all(kw["mp_policy"].param_dtype == want for _, kw in fake_fully_shard)


def test_fsdp_mesh_on_cuda_build_without_gpu_is_cpu(cuda_no_gpu, fake_mesh, fake_fully_shard, capsys):
    from paratrain.strategies.fsdp import FSDPStrategy

    FSDPStrategy(dist_info(CPU, rank=0, world=2)).wrap(mlp())
    assert fake_mesh[0].device_type == "cpu"


@pytest.mark.parametrize("tp_size, shape", [(None, (1, 2)), (1, (2, 1))])
def test_tensor_mesh_is_cuda(two_gpus, fake_mesh, tp_size, shape):
    from paratrain.strategies.tensor import TensorOptions, TensorParallelStrategy

    s = TensorParallelStrategy(dist_info(cuda(1), rank=1, world=2), options=TensorOptions(tp_size=tp_size))
    mesh = s.mesh
    assert (mesh.device_type, mesh.shape, mesh.names) == ("cuda", shape, ("dp", "tp"))


def test_tensor_parallelizes_over_the_cuda_tp_mesh(two_gpus, fake_mesh, monkeypatch, capsys):
    from paratrain.strategies.tensor import TensorParallelStrategy

    calls = []
    monkeypatch.setattr(torch.distributed.tensor.parallel, "parallelize_module",
                        lambda module, mesh, plan: calls.append((module, mesh, plan)) or module)
    net = mlp()
    assert TensorParallelStrategy(dist_info(cuda(0), rank=0, world=2)).wrap(net) is net
    (module, mesh, plan), = calls
    assert module is net and (mesh.device_type, mesh.names, mesh.shape) == ("cuda", ("tp",), (2,))
    assert sorted(plan) == ["0", "2"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved1f1b"])
def test_pipeline_stage_lives_on_the_process_device(two_gpus, fake_to, monkeypatch, schedule):
    from paratrain.strategies.pipeline import PipelineStrategy, PipelineModule, PipelineOptions

    stages, schedules = [], []

    class Stage:
        def __init__(self, submodule, stage_index, num_stages, device, *args, **kwargs):
            stages.append((submodule, stage_index, num_stages, device))

    class Schedule:
        def __init__(self, stage, n_microbatches, **kwargs):
            schedules.append((type(self).__name__, n_microbatches, kwargs))

    monkeypatch.setattr(torch.distributed.pipelining, "PipelineStage", Stage)
    monkeypatch.setattr(torch.distributed.pipelining, "ScheduleGPipe", type("ScheduleGPipe", (Schedule,), {}))
    monkeypatch.setattr(torch.distributed.pipelining, "Schedule1F1B", type("Schedule1F1B", (Schedule,), {}))
    monkeypatch.setattr(torch.distributed.pipelining, "ScheduleInterleaved1F1B",
                        type("ScheduleInterleaved1F1B", (Schedule,), {}))
    net = mlp()
    s = PipelineStrategy(dist_info(cuda(1), rank=1, world=2), options=PipelineOptions(schedule=schedule, n_microbatches=2))
    pipe = s.setup_model(net)
    mine = [1, 3] if schedule == "interleaved1f1b" else [1]  # stages_per_rank 2: rank 1 of 2 holds stages 1 and 3 of 4
    assert isinstance(pipe, PipelineModule) and pipe.device == cuda(1) and pipe.indices == mine
    assert fake_to == [(pipe.parts[i], cuda(1)) for i in mine]  # only this rank's stages go to its GPU
    pipe._schedule(torch.Size([8, 4]), 2, training=True)
    assert [(index, n, device) for _, index, n, device in stages] == [(i, 2 * len(mine), cuda(1)) for i in mine]
    assert schedules[0][0] == {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                               "interleaved1f1b": "ScheduleInterleaved1F1B"}[schedule]


def test_devices_default_to_every_gpu(two_gpus, fake_to):
    from paratrain.strategies.devices import DevicesStrategy, DeviceSplit, default_devices

    assert default_devices(cuda(0)) == ["cuda:0", "cuda:1"]
    assert default_devices(CPU) == ["cpu", "cpu"]  # accelerator=cpu on a GPU machine
    net = mlp()
    split = DevicesStrategy(dist_info(cuda(0))).setup_model(net)
    assert isinstance(split, DeviceSplit)
    assert split.devices == [cuda(0), cuda(1)] and split.output_device == cuda(0)
    assert [d for _, d in fake_to] == [cuda(0), cuda(1)]
    assert [m for m, _ in fake_to] == list(split.parts)


def test_devices_one_gpu(one_gpu):
    from paratrain.strategies.devices import default_devices

    assert default_devices(cuda(0)) == ["cuda:0"]


def test_devices_cuda_build_without_gpu(cuda_no_gpu):
    from paratrain.strategies.devices import default_devices

    assert default_devices(select_device(0)) == ["cpu", "cpu"]


def test_ps_moves_the_model_to_the_device(two_gpus, fake_to):
    from paratrain.strategies.ps import ParameterServerStrategy

    net = mlp()
    assert ParameterServerStrategy(dist_info(cuda(1), rank=1, world=2)).setup_model(net) is net
    assert fake_to == [(net, cuda(1))]


# --- precision -----------------------------------------------------------------------------------------

@pytest.fixture
def fake_amp(monkeypatch):
    """torch.amp.GradScaler and torch.autocast record their arguments."""
    made: dict[str, list] = {"scaler": [], "autocast": []}

    class GradScaler:
        def __init__(self, *args, **kwargs):
            made["scaler"].append((args, kwargs))

    def autocast(*args, **kwargs):
        made["autocast"].append((args, kwargs))
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.amp, "GradScaler", GradScaler)
    monkeypatch.setattr(torch, "autocast", autocast)
    return made


@pytest.mark.parametrize("sim, device, kind", [("one_gpu", cuda(0), "cuda"), ("two_gpus", cuda(1), "cuda"),
                                               ("cuda_no_gpu", CPU, "cpu")])
def test_precision_device_type(request, fake_amp, sim, device, kind):
    import paratrain.precision as precision_lib

    request.getfixturevalue(sim)
    fp16 = precision_lib.build("fp16-mixed", device)
    assert fake_amp["scaler"] == [((kind,), {})]
    for name, dtype in [("fp16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16),
                        ("bf16-true", torch.bfloat16), ("fp16-true", torch.float16)]:
        p = fp16 if name == "fp16-mixed" else precision_lib.build(name, device)
        fake_amp["autocast"].clear()
        with p.forward_context():
            pass
        assert fake_amp["autocast"] == [((kind,), {"dtype": dtype})], name
    assert len(fake_amp["scaler"]) == 2  # fp16-true's scaler too
    fake_amp["scaler"].clear()
    static = precision_lib.build("fp16-mixed", device, loss_scale=128.0)
    assert static.scaler is None and fake_amp["scaler"] == []


def test_real_grad_scaler_and_autocast_stay_enabled_on_the_simulated_gpu(one_gpu):
    """torch's own GradScaler/autocast, unpatched: nothing touches the GPU at construction, and they
    do not switch themselves off as on a machine without CUDA."""
    import paratrain.precision as precision_lib

    p = precision_lib.build("fp16-mixed", cuda(0))
    assert p.scaler.is_enabled()
    with precision_lib.build("bf16-mixed", cuda(0)).forward_context():
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16


# --- bench: the matrix, the runner, the workers ------------------------------------------------------------

@pytest.fixture
def probes(monkeypatch):
    """The matrix's precision probe runs a kernel: record on which device it would, and pass."""
    from paratrain.bench import matrix

    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(matrix, "_probe_precision", lambda precision, device: seen.append((precision, device)))
    return seen


def _matrix(overrides: dict | None = None) -> dict[str, str | None]:
    from paratrain.bench.matrix import BenchSpec, build_matrix
    from paratrain.config import TrainConfig

    spec = BenchSpec(strategies=["single", "dp", "ddp"], world_sizes=[1, 2, 4], precisions=["32", "bf16-mixed"],
                     comm_hooks=["none", "bf16"], baseline=False, trap=False)
    base = TrainConfig().with_overrides(overrides or {})
    return {c.label: c.skip for c in build_matrix(spec, base, train_size=1438)}


def test_matrix_two_gpus(two_gpus, probes):
    cells = _matrix()
    assert {d for _, d in probes} == {"cuda"}
    assert cells["dp x2"] is None and cells["ddp x2"] is None and cells["ddp x2 bf16-mixed"] is None
    assert cells["dp x4"] == "DataParallel over 4 GPUs needs 4 GPUs in one process; 2 visible"
    assert cells["ddp x4"] == "4 processes need 4 GPUs; 2 visible"
    assert cells["ddp x2 hook=bf16"] is None  # NCCL has the bf16 hook
    assert not any("nccl" in label for label in cells)  # ddp cells run on nccl already


def test_matrix_one_gpu(one_gpu, probes):
    cells = _matrix()
    assert cells["single"] is None and cells["ddp x2"] == "2 processes need 2 GPUs; 1 visible"
    assert cells["dp x2"].startswith("DataParallel over 2 GPUs")


def test_matrix_cuda_build_without_gpu(cuda_no_gpu, probes):
    cells = _matrix()
    assert {d for _, d in probes} == {"cpu"}
    assert cells["ddp x4"] is None and cells["dp x2"].endswith("0 visible")
    assert cells["ddp x2 nccl"].startswith("nccl needs CUDA GPUs")
    assert cells["ddp x2 hook=bf16"].startswith("the bf16 compression hook needs CUDA")


def test_matrix_accelerator_cpu_on_gpus_counts_no_gpu(two_gpus, probes):
    """The cells run on the CPU (select_device honours accelerator=cpu): the matrix must not count,
    probe or skip by the GPUs they will not use."""
    cells = _matrix({"parallel.accelerator": "cpu"})
    assert {d for _, d in probes} == {"cpu"}
    assert cells["ddp x4"] is None and cells["dp x2"].endswith("0 visible")


def test_probe_refuses_bf16_on_a_gpu_without_it(one_gpu, monkeypatch):
    from paratrain.bench.matrix import _probe_precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert _probe_precision("bf16-mixed", "cuda") == "this GPU has no bf16 support"
    assert _probe_precision("32", "cuda") is None


def test_runner_machine_and_timing(two_gpus):
    from paratrain.bench.matrix import cuda_devices
    from paratrain.bench.runner import _machine

    m = _machine()
    assert m["gpus"] == 2 and m["gpu"] == "Simulated GPU"
    assert cuda_devices() == 2 and cuda_devices("cuda") == 2 and cuda_devices("cpu") == 0


@pytest.mark.parametrize("visible, want", [(None, "0,1"), ("3,5,7", "3,5"), ("GPU-a, GPU-b", "GPU-a,GPU-b")])
def test_runner_dp_cell_sees_its_gpus(two_gpus, monkeypatch, visible, want):
    """A dp cell is one process over the first world_size GPUs this one may use, not GPUs 0..N-1
    regardless of CUDA_VISIBLE_DEVICES."""
    from paratrain.bench import runner
    from paratrain.bench.matrix import BenchSpec, Cell
    from paratrain.config import TrainConfig

    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    launches = []

    def launch(fn, nprocs, args=(), timeout=None, env=None, **how):
        launches.append((nprocs, dict(env)))
        return [{"status": "skipped", "reason": "recorded"}] * nprocs

    monkeypatch.setattr(runner, "launch", launch)
    result = runner._run_one(Cell(strategy="dp", world_size=2, global_batch=64), BenchSpec(), TrainConfig(), None)
    assert result.reason == "recorded"
    (nprocs, env), = launches
    assert nprocs == 1 and env["CUDA_VISIBLE_DEVICES"] == want
    runner._run_one(Cell(strategy="ddp", world_size=2, global_batch=64), BenchSpec(), TrainConfig(), None)
    assert launches[1][0] == 2 and "CUDA_VISIBLE_DEVICES" not in launches[1][1]


class _Stop(Exception):
    pass


def test_baseline_worker_binds_its_gpu_and_uses_nccl(two_gpus, monkeypatch):
    from paratrain.bench import worker
    from paratrain.bench.matrix import BASELINE, Cell
    from paratrain.config import TrainConfig

    calls = []

    def init_process_group(*args, **kwargs):
        calls.append((args, kwargs))
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(worker, "preload_dynamo", lambda: None)
    cell = Cell(strategy=BASELINE, world_size=2, global_batch=64, group="baseline")
    cfg = worker.cell_config(TrainConfig(), cell, epochs=1)
    with pytest.raises(_Stop):
        worker._run_baseline(1, cfg, cell, {"warmup_steps": 1}, None, None)
    assert two_gpus.set_device == [cuda(1)]
    assert calls == [(("nccl",), {})]


def test_baseline_worker_on_cuda_build_without_gpu(cuda_no_gpu, monkeypatch):
    from paratrain.bench import worker
    from paratrain.bench.matrix import BASELINE, Cell
    from paratrain.config import TrainConfig

    calls = []

    def init_process_group(*args, **kwargs):
        calls.append((args, kwargs))
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(worker, "preload_dynamo", lambda: None)
    cell = Cell(strategy=BASELINE, world_size=2, global_batch=64, group="baseline")
    with pytest.raises(_Stop):
        worker._run_baseline(1, worker.cell_config(TrainConfig(), cell, epochs=1), cell, {"warmup_steps": 1}, None, None)
    assert calls == [(("gloo",), {})] and cuda_no_gpu.set_device == []


def test_bench_memory_and_clock_on_cuda(two_gpus, monkeypatch):
    from paratrain.bench.measure import PeakMemory, sync
    from paratrain.bench.worker import _Clock

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append(("read", device)) or 123)
    mem = PeakMemory(cuda(1))
    assert mem.method == "cuda-max-allocated"
    mem.reset()
    assert mem.read() == 123
    sync(cuda(1))
    assert calls == [("sync", cuda(1)), ("reset", cuda(1)), ("read", cuda(1)), ("sync", cuda(1))]
    clock = _Clock(cuda(1), 1, 3, mem)
    for step in range(4):
        clock.on_step(step)
    summary = clock.summary()
    assert summary["timing"] == "mean (synchronised window)" and summary["step_time_s"] == summary["step_mean_s"]


# --- checkpoint RNG ------------------------------------------------------------------------------------------

@pytest.fixture
def fake_cuda_rng(monkeypatch):
    """Per-device CUDA generator states, as torch.cuda's RNG functions see them."""
    states = {i: torch.tensor([10 + i], dtype=torch.uint8) for i in range(2)}
    sets: list[tuple[int, torch.Tensor]] = []

    def current() -> int:
        return torch.cuda.current_device()

    def get_rng_state(device="cuda"):
        return states[_index(device, current())].clone()

    def set_rng_state(new_state, device="cuda"):
        sets.append((_index(device, current()), new_state.clone()))

    def set_rng_state_all(new_states):
        for i, s in enumerate(new_states):
            set_rng_state(s, i)

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [get_rng_state(i) for i in range(len(states))])
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_rng_state_all)
    return sets


def test_rng_saves_and_restores_this_process_gpu(two_gpus, fake_cuda_rng):
    from paratrain.checkpoint.rng import rng_state, set_rng_state

    torch.cuda.set_device(1)  # what init does on local rank 1
    state = rng_state()
    assert "cuda" in state
    set_rng_state(state)
    restored = {i: s.tolist() for i, s in fake_cuda_rng}
    assert restored.get(1) == [11]  # cuda:1's own generator state, back on cuda:1
    assert all(s == [10 + i] for i, s in restored.items())


def test_rng_before_cuda_is_initialized_has_no_cuda_state(two_gpus, monkeypatch):
    from paratrain.checkpoint.rng import rng_state

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert "cuda" not in rng_state()


def test_rng_from_a_gpu_run_loads_on_a_cuda_build_without_gpu(cuda_no_gpu, monkeypatch):
    from paratrain.checkpoint.rng import rng_state, set_rng_state

    state = rng_state()
    assert "cuda" not in state
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a, **k: pytest.fail("set a CUDA RNG without a GPU"))
    set_rng_state({**state, "cuda": torch.tensor([1], dtype=torch.uint8)})  # the CPU streams still resume


def test_rng_one_process_over_two_gpus_resumes_both(two_gpus, fake_cuda_rng):
    from paratrain.checkpoint.rng import rng_state, set_rng_state

    set_rng_state(rng_state())
    assert {i: s.tolist() for i, s in fake_cuda_rng} == {0: [10], 1: [11]}


def test_rng_of_more_gpus_resumes_the_ones_here_and_old_checkpoints_their_one(two_gpus, fake_cuda_rng):
    from paratrain.checkpoint.rng import rng_state, set_rng_state

    state = rng_state()
    u8 = torch.uint8
    set_rng_state({**state, "cuda_all": [torch.tensor([20 + i], dtype=u8) for i in range(4)]})  # saved on 4 GPUs
    assert {i: s.tolist() for i, s in fake_cuda_rng} == {0: [20], 1: [21]}
    fake_cuda_rng.clear()
    old = {k: v for k, v in state.items() if k != "cuda_all"}  # written before every GPU was saved
    set_rng_state({**old, "cuda": torch.tensor([7], dtype=u8)})
    assert [(i, s.tolist()) for i, s in fake_cuda_rng] == [(torch.cuda.current_device(), [7])]
