"""Rank/world detection from each launcher's environment, backend and device choice, helpers."""

import pytest
import torch

import paratrain
from paratrain.env import detect_process, global_rank
from paratrain.env.devices import select_backend, select_device
from paratrain.env.slurm import first_host

LAUNCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
               "SLURM_NNODES", "SLURM_NODELIST", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
               "MPI_LOCALNRANKS", "SLURM_TASKS_PER_NODE", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS",
               "SLURM_STEP_NUM_NODES", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
               "SLURM_NPROCS"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for v in LAUNCH_VARS:
        monkeypatch.delenv(v, raising=False)


def test_no_launcher_is_one_process():
    info = detect_process()
    assert (info.rank, info.world_size, info.source) == (0, 1, "single")
    assert paratrain.rank() == 0 and paratrain.world_size() == 1 and paratrain.is_main_process()


def test_torchrun_env(monkeypatch):
    # node 1 of 2, 4 procs per node, local rank 3 -> rank 7 (seed 001's arithmetic)
    for k, v in dict(RANK="7", WORLD_SIZE="8", LOCAL_RANK="3", LOCAL_WORLD_SIZE="4", GROUP_RANK="1",
                     MASTER_ADDR="10.0.0.1", MASTER_PORT="1234", TORCHELASTIC_RUN_ID="x").items():
        monkeypatch.setenv(k, v)
    info = detect_process()
    assert (info.rank, info.world_size, info.local_rank, info.node_rank, info.nnodes) == (7, 8, 3, 1, 2)
    assert info.rank == global_rank(info.node_rank, info.local_world_size, info.local_rank)
    assert (info.master_addr, info.master_port, info.source) == ("10.0.0.1", 1234, "torchelastic")


def test_slurm_env(monkeypatch):
    for k, v in dict(SLURM_STEP_ID="0", SLURM_PROCID="5", SLURM_NTASKS="6", SLURM_LOCALID="2", SLURM_NODEID="1", SLURM_NNODES="2",
                     SLURM_NODELIST="gpu[07-08]", SLURM_JOB_ID="4242").items():
        monkeypatch.setenv(k, v)
    info = detect_process()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node_rank) == (5, 6, 2, 3, 1)
    assert info.rank == global_rank(1, 3, 2)
    assert info.master_addr == "gpu07" and info.source == "slurm"
    assert info.master_port == 15000 + 4242


def test_an_sbatch_script_is_not_a_task(monkeypatch):
    """The batch script of `sbatch --ntasks 2` has SLURM_PROCID=0 and SLURM_NTASKS=2 but no step id
    (as the lab's Slurm shows): it starts the job, it is not rank 0 of 2 waiting for a peer."""
    for k, v in dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NNODES="1",
                     SLURM_TASKS_PER_NODE="2", SLURM_JOB_ID="7").items():
        monkeypatch.setenv(k, v)
    assert detect_process().world_size == 1
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # srun's tasks have one
    assert (detect_process().world_size, detect_process().source) == (2, "slurm")


def test_openmpi_env(monkeypatch):
    for k, v in dict(OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="1",
                     OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_ADDR="host0").items():
        monkeypatch.setenv(k, v)
    info = detect_process()
    assert (info.rank, info.world_size, info.local_rank, info.node_rank, info.source) == (3, 4, 1, 1, "mpi")


def test_mpich_and_intel_mpi_env(monkeypatch):
    """Hydra (MPICH, Intel MPI): PMI_RANK/PMI_SIZE; once this was silently a world of one."""
    for k, v in dict(PMI_RANK="1", PMI_SIZE="2", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2").items():
        monkeypatch.setenv(k, v)
    info = detect_process()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.source) == (1, 2, 1, 2, "mpi")


def test_slurm_uneven_tasks_per_node(monkeypatch):
    # 7 tasks as 2,2,2,1: the last node's only task is rank 6, local rank 0 of 1.
    for k, v in dict(SLURM_STEP_ID="0", SLURM_PROCID="6", SLURM_NTASKS="7", SLURM_LOCALID="0", SLURM_NODEID="3", SLURM_NNODES="4",
                     SLURM_NODELIST="n[1-4]", SLURM_TASKS_PER_NODE="2(x3),1", PMI_RANK="6", PMI_SIZE="7").items():
        monkeypatch.setenv(k, v)
    info = detect_process()
    assert (info.rank, info.world_size, info.local_world_size, info.node_rank, info.source) == (6, 7, 1, 3, "slurm")


def test_slurm_tasks_per_node_parsing():
    from paratrain.env.slurm import tasks_per_node

    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE='x'"):
        tasks_per_node("x")


def _set(monkeypatch, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)


# What a task of `srun` started by mpirun/mpiexec inside an allocation carries: the daemon's (or
# Hydra proxy's) step, one task per node, here the second of two nodes.
_DAEMON_STEP = dict(SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID="1",
                    SLURM_NNODES="2", SLURM_NODELIST="n[1-2]", SLURM_JOB_ID="9")


def test_mpirun_inside_a_slurm_allocation_is_mpi(monkeypatch):
    _set(monkeypatch, **_DAEMON_STEP, OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1",
         OMPI_COMM_WORLD_LOCAL_SIZE="4", MASTER_ADDR="n1")
    info = detect_process()
    assert (info.rank, info.world_size, info.local_rank, info.source) == (5, 8, 1, "mpi")


def test_hydra_mpiexec_inside_a_slurm_allocation_is_mpi(monkeypatch):
    _set(monkeypatch, **_DAEMON_STEP, PMI_RANK="6", PMI_SIZE="8", MPI_LOCALRANKID="2", MPI_LOCALNRANKS="4",
         MASTER_ADDR="n1")
    info = detect_process()
    assert (info.rank, info.world_size, info.local_rank, info.source) == (6, 8, 2, "mpi")


def test_mpi_on_several_nodes_needs_master_addr(monkeypatch):
    """mpirun on 2 nodes without MASTER_ADDR: one line before joining (each node once waited on its
    own loopback until the timeout)."""
    _set(monkeypatch, OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1",
         OMPI_COMM_WORLD_LOCAL_SIZE="4")
    with pytest.raises(ValueError, match="8 ranks from mpi on several nodes .4 on this one. but MASTER_ADDR is not set: "
                                         "export MASTER_ADDR"):
        paratrain.init(backend="gloo", timeout_s=5)
    assert not torch.distributed.is_initialized()


def test_slurm_step_variables_win_over_the_job_s(monkeypatch):
    """A step of 2 tasks on the job's second node, in an 8-task job of 2 nodes (srun -n 2 -r1)."""
    _set(monkeypatch, SLURM_STEP_ID="3", SLURM_PROCID="1", SLURM_NTASKS="8", SLURM_STEP_NUM_TASKS="2",
         SLURM_NNODES="2", SLURM_STEP_NUM_NODES="1", SLURM_TASKS_PER_NODE="4(x2)", SLURM_STEP_TASKS_PER_NODE="2",
         SLURM_LOCALID="1", SLURM_NODEID="0", SLURM_NODELIST="n[1-2]", SLURM_STEP_NODELIST="n2", SLURM_JOB_ID="9")
    info = detect_process()
    assert (info.rank, info.world_size, info.local_world_size, info.master_addr) == (1, 2, 2, "n2")
    # two steps of one job do not share a port
    assert info.master_port == 15000 + (9 + 7919 * 3) % 20000
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert detect_process().master_port == 15000 + 9


@pytest.mark.parametrize("port", ["0", "70000", "-5"])
def test_a_master_port_out_of_range_is_named(monkeypatch, port):
    _set(monkeypatch, RANK="0", WORLD_SIZE="2", MASTER_PORT=port)
    with pytest.raises(ValueError, match=f"MASTER_PORT {port} .* is not a TCP port"):
        detect_process()


def test_gloo_interface_on_the_master_node_whose_name_is_loopback(monkeypatch):
    from paratrain.env import network

    assert network.gloo_interface("127.0.0.1", True) == "lo"
    monkeypatch.setattr(network, "interface_towards", lambda host: "lo")  # /etc/hosts: 127.0.1.1 this-host
    monkeypatch.setattr(network, "default_route_interface", lambda: "eth7")
    assert network.gloo_interface("this-host", several_nodes=True) == "eth7"
    assert network.gloo_interface("this-host", several_nodes=False) == "lo"
    monkeypatch.setattr(network, "interface_towards", lambda host: "ib0")
    assert network.gloo_interface("master", several_nodes=True) == "ib0"


def test_torchrun_wins_over_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert detect_process().world_size == 2


def test_bad_env_values_are_named(monkeypatch):
    monkeypatch.setenv("RANK", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK='x'"):
        detect_process()
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ValueError, match="rank 5 .* outside world size 2"):
        detect_process()


@pytest.mark.parametrize("nodelist, host", [("node[03-05,7]", "node03"), ("a,b", "a"), ("single", "single"),
                                            ("node[01-03,7],gpu-a[1-2]", "node01"), ("nid[00001-00004]-hsn", "nid00001-hsn"),
                                            ("a-[001-004].cluster", "a-001.cluster"), ("rack[1-2]-node[01-04]", "rack1-node01")])
def test_slurm_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_backend_and_device_choice():
    cpu = torch.device("cpu")
    assert select_backend(cpu) == "gloo"
    assert select_backend(torch.device("cuda", 0)) == "nccl"
    with pytest.raises(RuntimeError, match="nccl"):
        select_backend(cpu, "nccl")
    with pytest.raises(RuntimeError, match="backend 'xccl' needs xpu devices, but this process runs on cpu: use gloo"):
        select_backend(cpu, "xccl")
    with pytest.raises(RuntimeError, match="backend 'hccl' needs npu devices"):
        select_backend(cpu, "hccl")
    if not torch.distributed.is_backend_available("xccl"):  # a build without XPU support
        with pytest.raises(RuntimeError, match="'xccl' was asked for but this torch does not have it"):
            select_backend(torch.device("xpu", 0), "xccl")
    with pytest.raises(ValueError, match="backend 'tcp' is unknown"):
        select_backend(cpu, "tcp")
    if not torch.distributed.is_mpi_available():
        with pytest.raises(RuntimeError, match="mpi"):
            select_backend(cpu, "mpi")
    assert select_device(0, "cpu") == cpu
    if not torch.cuda.is_available():
        assert select_device(3) == cpu


def test_helpers_without_process_group(tmp_path, capsys):
    paratrain.print_once("hello")
    assert capsys.readouterr().out == "hello\n"
    paratrain.barrier()
    with paratrain.main_process_first():
        pass
    paratrain.save_on_main({"a": torch.ones(2)}, tmp_path / "x.pt")
    assert torch.load(tmp_path / "x.pt", weights_only=True)["a"].sum() == 2
    assert not list(tmp_path.glob("*.tmp-*"))
    assert paratrain.seed_everything(5) == 5


def _helpers_worker(local_rank, path):
    import paratrain as pt

    d = pt.init()
    order = []
    with pt.main_process_first():
        order.append(("enter", d.rank))
    pt.save_on_main({"rank": d.rank}, path)
    pt.barrier()
    seed = pt.seed_everything(10, offset_by_rank=True)
    pt.destroy()
    return d.rank, d.is_main_process, seed


def test_helpers_in_a_process_group(tmp_path):
    out = paratrain.launch(_helpers_worker, nprocs=2, args=(str(tmp_path / "m.pt"),), timeout=60)
    assert out == [(0, True, 10), (1, False, 11)]  # per-rank seeding (seed 002)
    assert torch.load(tmp_path / "m.pt", weights_only=True) == {"rank": 0}  # only main saved


def test_interface_towards_names_the_interface_holding_the_route():
    # gloo binds the interface that reaches the master (multi-node) instead of its hostname guess,
    # which is loopback where /etc/hosts maps the hostname to 127.0.x.1; tests/lab runs it across hosts.
    from paratrain.env.process import interface_towards

    assert interface_towards("127.0.0.1") == "lo"
    assert interface_towards("localhost") == "lo"
    assert interface_towards("no-such-host.invalid") is None


def test_a_process_group_the_script_made_is_where_the_process_is():
    """mp.spawn and the script's own init_process_group(rank=r, world_size=2), no launcher variables
    (seed 001): Parallel takes rank and world size from the group, so each rank reads its half of
    the global batch and only rank 0 is the main process. Real processes over gloo, hard limit."""
    import json
    import subprocess
    import sys

    from clitools import ROOT, cli_env, finish
    from paratrain.env.network import free_port

    script = ROOT / "tests" / "scripts" / "spawn_own_group.py"
    proc = subprocess.Popen([sys.executable, str(script), str(free_port())], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    res = finish(proc, timeout=90)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = sorted((json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")), key=lambda d: d["rank"])
    assert [(d["rank"], d["world"], d["main"], d["helper_rank"]) for d in ranks] == [(0, 2, True, 0), (1, 2, False, 1)]
    assert sorted(ranks[0]["rows"] + ranks[1]["rows"]) == [float(i) for i in range(8)]  # the global batch, split


def test_one_seed_mixing_function_derives_every_seed():
    """Issue 25: seeds were mixed two ways (``seed * 1_000_003 + x`` in three places, splitmix in the
    loaders; blake2b for a step's augmentation). ``mix_seed`` is the one; the epoch order keeps the
    first release's formula, so a seed keeps its data order."""
    import ast
    import pathlib

    from paratrain.data.loaders import sample_seed, sample_seeds, step_seed
    from paratrain.env.seeding import mix_seed

    assert mix_seed(3, 1) == 3 * 1_000_003 + 1 and mix_seed(-1, 0) == (-1_000_003) % 2**64
    assert mix_seed(2**62, 5, 7, bits=63) == ((2**62 * 1_000_003 + 5) * 1_000_003 + 7) % 2**63
    assert sample_seed(3, 2, 9) == mix_seed(3, 2, 9, bits=63) and step_seed(3, 4, 1) == mix_seed(3, 4, 1, bits=63)
    assert sample_seeds(2**61, 3, [0, 1, 2**40]) == [sample_seed(2**61, 3, i) for i in (0, 1, 2**40)]
    assert len({sample_seed(0, e, i) for e in range(3) for i in range(1000)}) == 3000
    root = pathlib.Path(__file__).resolve().parents[2] / "paratrain"
    mixers = []  # the stride or splitmix's constant anywhere but mix_seed's module; a hash among the data's seeds
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "env/seeding.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and node.value in (1_000_003, 0x9E3779B97F4A7C15)) or (
                    isinstance(node, ast.Import) and path.parent.name == "data"
                    and any(a.name == "hashlib" for a in node.names)):
                mixers.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert mixers == []


def test_a_free_port_is_chosen_outside_the_ports_outgoing_connections_take():
    """The launch's port is free when chosen and stays so until rank 0 binds it: not one of the kernel's
    ephemeral ports, which gloo's many outgoing connections (another job's, another test's) may take first."""
    import random
    import socket

    from paratrain.env.network import _ephemeral_range, free_port

    lo, hi = _ephemeral_range()
    state = random.getstate()
    ports = {free_port() for _ in range(20)}
    assert random.getstate() == state  # a seeded run's random draws are not disturbed
    assert len(ports) > 1 and all(not lo <= p <= hi for p in ports), (lo, hi, ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
