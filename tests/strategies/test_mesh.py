"""``mesh``: one way to say the layout (``Parallel(mesh=...)``, ``--mesh``, ``[parallel] mesh``), its
one-line refusals, and every data-parallel x tensor-parallel composition at world size 4 in float64
against plain PyTorch in one process (issue 35): HSDP 2x2, dp_shard 2 x tp 2, dp_replicate 2 x tp 2,
plain replication, on a tiny HuggingFace Llama (untied) and nanoGPT's GPT (tied embeddings)."""

from __future__ import annotations

import pytest
import torch
import zoo
from parity import assert_same_state

import paratrain
from paratrain.config.parallel import ParallelConfig
from paratrain.strategies.mesh import MeshOptions, describe

pytestmark = pytest.mark.timeout(300)
GLOBAL_BATCH, STEPS, SEED, N = 8, 3, 5, 24
LAYOUTS = {
    "hsdp": {"dp_replicate": 2, "dp_shard": 2},
    "dp_shard2_tp2": {"dp_shard": 2, "tp": 2},
    "dp_replicate2_tp2": {"dp_replicate": 2, "tp": -1},
    "replicate": {"dp_replicate": 4},
}
KINDS = ("llama", "gpt")
INIT_MODULE = {"dp_shard2_tp2"}  # built on the meta device under pt.init_module(): each rank materialises its part


def build(kind: str) -> torch.nn.Module:
    return zoo.GPT() if kind == "gpt" else zoo.hf_model(kind)


# --------------------------------------------------------------------------- the spelling


def test_the_layout_is_said_as_sizes_that_make_the_world():
    assert MeshOptions.parse("pp=2, dp_shard=2,tp=2") == MeshOptions(pp=2, dp_shard=2, tp=2)
    assert MeshOptions(tp=2).sizes(8) == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 2}  # dp_shard: the rest
    assert MeshOptions(dp_replicate=-1, dp_shard=2).sizes(8)["dp_replicate"] == 4
    assert describe(MeshOptions(dp_replicate=2, dp_shard=2).sizes(4)) == "dp_replicate=2,dp_shard=2"
    assert MeshOptions(pp=2, tp=2).smallest_world() == 4 and MeshOptions(dp_shard=-1, tp=2).smallest_world() == 2
    assert not MeshOptions().given and MeshOptions(tp=1).given


@pytest.mark.parametrize("mesh, world, words", [
    ("tp=3", 4, "do not divide the world size 4"),
    ("dp_replicate=2,dp_shard=2,tp=2", 4, "makes 8 processes, not the world size 4"),
    ("tp=-1,dp_shard=-1", 4, "only one dimension may be -1"),
    ("cp=2", 4, "is not NAME=SIZE with NAME one of pp, dp_replicate, dp_shard, tp"),
    ("tp=0", 4, "must be a whole number >= 1, or -1"),
    ("pp=2,dp_shard=3", 4, "makes 6 processes, not the world size 4"),
])
def test_a_bad_layout_is_one_line_before_any_worker(mesh, world, words):
    with pytest.raises(ValueError) as e:
        ParallelConfig(mesh=mesh).for_world(world)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("mesh, strategy", [("pp=2,tp=2", "auto"), ("dp_shard=2,tp=2", "auto"), ("pp=2", "mesh")])
def test_a_precision_or_strategy_a_part_refuses_is_one_line(mesh, strategy):
    with pytest.raises(ValueError) as e:
        ParallelConfig(mesh=mesh, strategy=strategy, precision="fp16-mixed" if strategy == "auto" else "32")
    words = "fp16-mixed" if strategy == "auto" else "strategy 'mesh' runs no pipeline"
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_strategy_names_are_shorthands_for_layouts():
    for strategy, options, layout in [("ddp", {}, {"dp_replicate": 4}), ("fsdp", {}, {"dp_shard": 4}),
                                      ("tensor", {"tensor": {"tp_size": 2}}, {"dp_shard": 2, "tp": 2}),
                                      ("pipeline", {}, {"pp": 4}), ("single", {}, {})]:
        world = 1 if strategy == "single" else 4
        assert ParallelConfig(strategy=strategy, **options).layout(world) == layout, strategy
    assert ParallelConfig(mesh={"pp": 4}).for_world(4).strategy == "pipeline"
    assert ParallelConfig(mesh="dp_shard=2,tp=2").for_world(4).strategy == "mesh"
    with pytest.raises(ValueError, match="strategy 'ddp' and mesh tp=2 are both set"):
        ParallelConfig(strategy="ddp", mesh="tp=2")
    # the batch is split over dp_replicate x dp_shard: the same samples per step in every layout
    assert ParallelConfig(mesh="dp_replicate=2,dp_shard=2").batch_plan(4).world_size == 4
    assert ParallelConfig(mesh="dp_replicate=2,tp=2").batch_plan(4).world_size == 2


# --------------------------------------------------------------------------- world size 4


def worker(rank: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, mesh in LAYOUTS.items():
        for kind in KINDS:
            out[f"{name}/{kind}"] = zoo.train_parallel(lambda kind=kind: build(kind), "auto", steps=STEPS, global_batch=GLOBAL_BATCH,
                                                       seed=SEED, data=zoo.Tokens(N), mesh=mesh, clip_grad_norm=0.05,
                                                       init_module=name in INIT_MODULE)
    pt = paratrain.Parallel(mesh=LAYOUTS["hsdp"])
    out["describe"] = pt.describe()
    out["norm"] = norm_over_dp_shard_and_tp()
    pt.close()
    return out


def norm_over_dp_shard_and_tp() -> tuple[int, float]:
    """The collectives and the value of a gradient norm partial over dp_shard and tp (clipping under fsdp + tp)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from paratrain.strategies.fsdp import total_norm
    from paratrain.strategies.mesh import layout_mesh

    mesh = layout_mesh("cpu", LAYOUTS["dp_shard2_tp2"])["dp_shard", "tp"]
    grad = distribute_tensor(torch.arange(32.0, dtype=torch.float64).view(8, 4), mesh, [Shard(0), Shard(1)])
    with CommDebugMode() as comm:
        norm = total_norm([grad])
    return comm.get_total_counts(), norm.item()


@pytest.fixture(scope="module")
def world4():
    pytest.importorskip("transformers")
    return paratrain.launch(worker, nprocs=4, timeout=240)[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_equals_one_process(world4, layout, kind):
    ref = zoo.train_plain(lambda: build(kind), steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED, data=zoo.Tokens(N),
                          clip_grad_norm=0.05)
    got = world4[f"{layout}/{kind}"]
    assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-9)


def test_the_run_names_its_mesh(world4):
    d = world4["describe"]
    assert d["strategy"] == "mesh" and d["mesh"] == "dp_replicate=2,dp_shard=2" and d["data_parallel_size"] == 4


def test_a_norm_over_dp_shard_and_tp_is_one_all_reduce(world4):
    """The layout's mesh has dp_shard x tp flattened into one group too (as torchtitan's has its data-parallel
    dimensions): DTensor reduced a norm one dimension at a time, two all-reduces, and warned on every rank."""
    assert world4["norm"] == (1, pytest.approx(torch.arange(32.0, dtype=torch.float64).norm().item(), rel=1e-12))


# --------------------------------------------------------------------------- the command line, the config file


def _parsed(argv: list[str]):
    from paratrain.cli.main import build_parser

    return build_parser().parse_args(argv)


def test_the_command_line_and_paratrain_toml_say_the_mesh(tmp_path, monkeypatch):
    from paratrain.cli import run as run_cli_module
    from paratrain.cli.train import build_config
    from paratrain.env import defaults

    cfg = build_config(_parsed(["train", "--mesh", "dp_replicate=2,tp=-1"]))
    assert cfg.parallel.mesh == MeshOptions(dp_replicate=2, tp=-1) and cfg.parallel.layout(4)["tp"] == 2
    (tmp_path / "job.toml").write_text('[parallel]\nmesh = {dp_shard = 2, tp = 2}\n')
    cfg = build_config(_parsed(["train", "--config", str(tmp_path / "job.toml")]))
    assert cfg.parallel.mesh == MeshOptions(dp_shard=2, tp=2)
    # paratrain run hands it to the script's Parallel() as a default
    env = run_cli_module.defaults_environment(_parsed(["run", "--mesh", "dp_replicate=2,dp_shard=2", "x.py"]))
    monkeypatch.setenv(defaults.VARIABLE, env[defaults.VARIABLE])
    assert ParallelConfig.of(None, {}).mesh == MeshOptions(dp_replicate=2, dp_shard=2)


def test_verify_proves_a_layout_against_one_process():
    from clitools import run_cli

    r = run_cli(["verify", "--nproc", "4", "--steps", "3", "--model", "mlp", "--mesh", "dp_replicate=2,dp_shard=2",
                 "--check-accumulation", "0"], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "world size 4 (mesh dp_replicate=2,dp_shard=2) vs world size 1" in r.stdout and "result: PASS" in r.stdout


# --------------------------------------------------------------------------- checkpoints across layouts


def resume_worker(rank: int, mesh: dict[str, int] | None, directory: str, save_at: int | None) -> dict[str, torch.Tensor]:
    """Train the Llama under ``mesh`` (None: one process) to step ``save_at`` and save, or load the newest
    checkpoint of ``directory`` and train on to ``STEPS``; the full state dict."""
    pt = paratrain.Parallel(global_batch=GLOBAL_BATCH, seed=SEED, **({"mesh": mesh} if mesh else {}))
    model = build("llama").double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt = pt.setup(model, opt)
    if save_at is None:
        pt.load_checkpoint(directory, model, opt)
    for ids, target in pt.train_loader(zoo.Tokens(N)):
        if pt.global_step == (save_at or STEPS):
            break
        opt.zero_grad()
        pt.backward(zoo.loss_of(model(ids), target))
        opt.step()
    if save_at is not None:
        pt.save_checkpoint(directory, model, opt)
    state = pt.full_state_dict(model)
    pt.close()
    return state


@pytest.mark.parametrize("saved, resumed", [(LAYOUTS["hsdp"], {"dp_shard": 2, "tp": 2}), ({"dp_shard": 2, "tp": 2}, None)])
def test_a_checkpoint_of_one_layout_resumes_under_another(tmp_path, saved, resumed):
    pytest.importorskip("transformers")
    paratrain.launch(resume_worker, nprocs=4, args=(saved, str(tmp_path), 1), timeout=120)
    got = paratrain.launch(resume_worker, nprocs=4 if resumed else 1, args=(resumed, str(tmp_path), None), timeout=120)[0]
    ref = zoo.train_plain(lambda: build("llama"), steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED, data=zoo.Tokens(N))
    assert_same_state({k: got[k] for k in ref}, ref, rtol=1e-9)


def test_paratrain_train_runs_pipelines_side_by_side_like_one_process(tmp_path):
    """The built-in loop end to end (train, the final evaluation, result.json) under pipelines side by side."""
    import json

    from clitools import run_cli

    results = {}
    for name, extra in {"one": ["--nproc-per-node", "1"], "pp2_dp_shard2": ["--mesh", "pp=2,dp_shard=2",
                                                                             "--nproc-per-node", "4"]}.items():
        r = run_cli(["train", "--model", "transformer", "--max-steps", "3", "--no-progress", "--log-dir",
                     str(tmp_path / name), *extra], timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
        results[name] = json.loads((tmp_path / name / "result.json").read_text())
    assert results["pp2_dp_shard2"]["mesh"] == "pp=2,dp_shard=2" and results["one"]["mesh"] == "1"
    one, mesh = results["one"]["test_loss"], results["pp2_dp_shard2"]["test_loss"]
    assert abs(mesh - one) <= 1e-4 * abs(one), (mesh, one)
    assert results["pp2_dp_shard2"]["test_count"] == results["one"]["test_count"]
