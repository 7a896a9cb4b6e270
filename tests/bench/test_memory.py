"""The memory estimate's formulas, by hand, and its measurement of a model on the meta device.
(Against measured peaks: ``benchmarks/memory_check.py``, whose smoke run is in tests/test_benchmarks.py.)"""

from __future__ import annotations

import pytest
import torch
from clitools import run_cli
from torch import nn

from paratrain.bench.memory import ModelFacts, bytes_per_param, estimate, measure_model, zero_model_states

MiB = 2**20


def facts(**kw) -> ModelFacts:
    base = dict(params=1000, largest_block=300, root_params=100, linear_params=800, largest_stage=600,
                activation_bytes=50.0, largest_saved_bytes=10.0, largest_param=200, largest_linear=True)
    base.update(kw)
    return ModelFacts(**base)


def test_bytes_per_parameter():
    assert bytes_per_param("32", "adamw") == {"w": 4, "g": 4, "m": 0, "s": 8}
    assert bytes_per_param("bf16-mixed", "sgd-momentum") == {"w": 4, "g": 4, "m": 0, "s": 4}
    assert bytes_per_param("bf16-true", "adam") == {"w": 2, "g": 2, "m": 4, "s": 8}  # ZeRO's 16 bytes
    with pytest.raises(ValueError, match="optimizer 'lion' is unknown"):
        bytes_per_param("32", "lion")


def test_single_and_ddp_by_hand():
    f = facts()
    e = estimate(f, "single", 1, micro_batch=4, optimizer="adamw")
    # static 1000*(4+8); the forward's end: activations and two gradients of the largest saved tensor;
    # the step phase: grads 4000 + Adam's two CPU temporaries of the largest tensor 8*200
    assert e.training == 12_000 + max((50 + 2 * 10) * 4, 4000 + 1600)
    assert e.parts["build"] == 4000 and e.peak == e.training
    ddp = estimate(f, "ddp", 2, micro_batch=4, optimizer="adamw")
    assert ddp.training == e.training + 4 * 1000  # DDP's gradient buckets
    assert estimate(f, "ddp", 1, 4).training == e.training  # nothing is wrapped at world size 1
    cuda = estimate(f, "single", 1, 4, optimizer="adamw", device="cuda")
    assert cuda.training == 12_000 + 4000 + 4 * 1000  # foreach: one temporary of every parameter


def test_fsdp_tensor_pipeline_by_hand():
    f = facts()
    fsdp = estimate(f, "fsdp", 4, micro_batch=4, optimizer="sgd")  # no optimizer state, no temporaries
    static = 1000 / 4 * 4
    forward = (50 + 2 * 10) * 4 + (100 + 2 * 300) * 4
    step = 1000 / 4 * 4 + (100 + 300) * 8
    assert fsdp.training == static + max(forward, step)
    off = estimate(f, "fsdp", 4, micro_batch=4, optimizer="sgd", offload=True)
    assert off.training == max(forward, (100 + 300) * 8)
    tensor = estimate(f, "tensor", 2, micro_batch=1, optimizer="sgd")
    assert tensor.training == (800 / 2 + 200) * 4 + max(70, (800 / 2 + 200) * 4)
    pipe = estimate(f, "pipeline", 2, micro_batch=1, optimizer="sgd", device="cuda")
    assert pipe.training == 600 * 4 + max(70, 600 * 4)
    on_cpu = estimate(f, "pipeline", 2, micro_batch=1, optimizer="sgd")  # the other stage's weights stay here too
    assert on_cpu.training == pipe.training + (1000 - 600) * 4
    with pytest.raises(ValueError, match="offload is fsdp's"):
        estimate(f, "ddp", 2, 1, offload=True)


def test_master_weights_by_hand():
    f = facts()
    e = estimate(f, "single", 1, micro_batch=4, optimizer="adamw")
    true = estimate(f, "single", 1, micro_batch=4, precision="bf16-true", optimizer="adamw")
    # bf16 weights, fp32 masters and moments; at the step the masters' fp32 gradients (the model's
    # bf16 ones freed as they are copied) and Adam's temporaries; activations in bf16
    assert true.training == 1000 * (2 + 4 + 8) + max((50 + 2 * 10) * 4 / 2, 1000 * 4 + 1600)
    assert true.training - e.training == 1000 * 2
    ddp = estimate(f, "ddp", 2, micro_batch=4, precision="bf16-true", optimizer="adamw")
    assert ddp.training == true.training + 2 * 1000  # DDP's buckets hold bf16 gradients


def test_pipeline_stages_are_cut_as_the_strategy_cuts():
    from paratrain.strategies._split import split_model

    def model():  # unequal layers: equal counts of children would not balance the parameters
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))

    f = measure_model(model, lambda k: torch.randn(k, 64))
    cut = split_model(model(), 2)
    assert f.largest_stage == max(sum(p.numel() for p in part.parameters()) for part in cut)


def test_a_stack_model_is_cut_between_its_blocks_as_the_strategy_cuts():
    import zoo

    from paratrain.strategies._stack import split_stack

    # a GPT: no sequence of children; the strategy cuts its blocks, the embeddings on the first
    # stage, the final norm and the (tied) head on the last
    f = measure_model(lambda: zoo.GPT(n_layer=4), lambda k: torch.randint(0, zoo.VOCAB, (k, zoo.LENGTH)))
    stages = split_stack(zoo.GPT(n_layer=4), 2, 0, distributed=False)
    assert stages is not None
    assert f.largest_stage == max(sum(p.numel() for p in stage.parameters()) for stage in stages)


@pytest.mark.parametrize("schedule,held", [("interleaved1f1b", [[0, 2], [1, 3]]), ("zbvzerobubble", [[0, 3], [1, 2]])])
def test_several_stages_a_rank_count_what_the_rank_holds(schedule, held):
    """Issue 35: with 2 stages a rank, a rank holds its stages' parameters (looped: 0 and 2; in a V: 0 and 3, the
    tied embedding and head on one rank, counted once)."""
    import zoo

    from paratrain.strategies._stack import split_stack

    f = measure_model(lambda: zoo.GPT(n_layer=4), lambda k: torch.randint(0, zoo.VOCAB, (k, zoo.LENGTH)),
                      schedule=schedule, stages_per_rank=2)
    stages = split_stack(zoo.GPT(n_layer=4), 4, 0, distributed=False)
    assert stages is not None
    ranks = [{id(p): p.numel() for i in mine for p in stages[i].parameters()} for mine in held]
    assert f.largest_stage == max(sum(rank.values()) for rank in ranks)
    tied = zoo.GPT(n_layer=4).transformer.wte.weight.numel()  # the V's rank 0 holds the embedding and the head: one weight
    assert f.stage_whole == ({2: tied} if schedule == "zbvzerobubble" else {})
    one = measure_model(lambda: zoo.GPT(n_layer=4), lambda k: torch.randint(0, zoo.VOCAB, (k, zoo.LENGTH)))
    assert f.largest_stage > one.largest_stage * 0.5  # not one stage of four: about half the model


def test_a_zero_bubble_schedule_keeps_a_sharded_stage_gathered_for_the_step():
    """pp2 x dp_shard2: under gpipe a stage's root and two blocks are in flight; under a zero-bubble schedule the whole
    stage (600 parameters, 4 bytes each) with its gradients, from its first forward to the step's end."""
    mesh = {"pp": 2, "dp_shard": 2}
    parts = {s: estimate(facts(schedule=s), "mesh", 4, 1, optimizer="sgd", sharded_init=True, mesh=mesh).parts
             for s in ("gpipe", "interleavedzerobubble")}
    gpipe, zero = (p["gradients + step temporaries"] for p in parts.values())
    assert zero - gpipe == (600 - (100 + 300)) * (4 + 4)  # the stage in place of the root and one block, w + g
    zero = max(parts["interleavedzerobubble"].values())
    assert max(estimate(facts(schedule="gpipe"), "mesh", 4, 1, optimizer="sgd", sharded_init=True,
                        mesh={"pp": 2, "dp_replicate": 2}).parts.values()) < zero  # replicas: nothing gathered


def test_a_weight_two_stages_of_a_rank_share_stays_whole_on_each_replica():
    """A V's tied embedding and head (200 of the rank's 600 parameters) are not sharded over dp_shard: each replica keeps
    them whole (strategies/pipeline.py), and a zero-bubble schedule gathers only the rest."""
    mesh = {"pp": 2, "dp_shard": 2}
    for schedule, gathered in (("gpipe", None), ("zbvzerobubble", 600 - 200)):
        plain, tied = (estimate(facts(schedule=schedule, stage_whole=w), "mesh", 4, 1, optimizer="sgd",
                                sharded_init=True, mesh=mesh).parts for w in ({}, {2: 200}))
        kept = "weights, masters, optimizer state"
        assert plain[kept] == 600 / 2 * 4 and tied[kept] == (400 / 2 + 200) * 4
        if gathered:
            assert tied["gradients + step temporaries"] == (400 / 2 + 200) * 4 + gathered * (4 + 4)
    replicas = {"pp": 2, "dp_replicate": 2}
    assert estimate(facts(stage_whole={2: 200}), "mesh", 4, 1, mesh=replicas).parts == \
        estimate(facts(), "mesh", 4, 1, mesh=replicas).parts  # whole anyway


def test_checkpointing_keeps_block_inputs_and_one_block():
    f = facts(outside_bytes=5.0, block_input_bytes=8.0, largest_inside_bytes=12.0, blocks=3)
    assert f.checkpointed_activation_bytes == 25.0
    with_ckpt = estimate(f, "single", 1, 100, optimizer="sgd", checkpointing=True)
    without = estimate(f, "single", 1, 100, optimizer="sgd")
    assert with_ckpt.training < without.training


def test_zero_formulas_match_deepspeed():
    P, N = 7_500_000_000, 64  # the ZeRO paper's 7.5B model on 64 GPUs: 120 GB, 31.4, 16.6, 1.88 GB
    assert zero_model_states(P, N, 0) == 120e9
    assert round(zero_model_states(P, N, 1) / 1e9, 1) == 31.4
    assert round(zero_model_states(P, N, 2) / 1e9, 1) == 16.6
    assert round(zero_model_states(P, N, 3) / 1e9, 2) == 1.88
    # paratrain's bf16-true with Adam is ZeRO's layout: 16 bytes per parameter
    assert sum(bytes_per_param("bf16-true", "adam").values()) == 16


def test_measure_on_meta_counts_what_autograd_saves():
    f = measure_model(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                      lambda k: torch.randn(k, 4),
                      lambda out, k: nn.functional.cross_entropy(out, torch.zeros(k, dtype=torch.long)))
    assert f.params == 58 and f.largest_param == 32 and f.buffers_bytes == 0
    # per sample: the input (4 floats), ReLU's output (8, shared with the second Linear), the loss's
    # log-softmax (2) and target (one int64); the weights are not counted
    assert f.activation_bytes == 4 * 4 + 8 * 4 + 2 * 4 + 8


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


def test_tensor_parallel_splits_the_activations_between_its_pairs():
    """What a block saves between a colwise Linear and its rowwise partner (here ReLU's 16 features,
    the down projection's input) is split over tp; the block's input, which the colwise layer
    saves whole on every rank, is not."""
    f = measure_model(lambda: nn.Sequential(_Block(), _Block(), nn.Linear(4, 2)), lambda k: torch.randn(k, 4),
                      lambda out, k: nn.functional.cross_entropy(out, torch.zeros(k, dtype=torch.long)))
    assert f.split_bytes == 2 * 16 * 4
    assert f.activation_bytes == 2 * (4 * 4 + 16 * 4) + 4 * 4 + 2 * 4 + 8
    whole = estimate(f, "tensor", 1, 8, optimizer="sgd", device="cuda")
    split = estimate(f, "tensor", 2, 8, optimizer="sgd", device="cuda")
    forward = "activations (forward)"
    assert whole.parts[forward] - split.parts[forward] == pytest.approx(8 * f.split_bytes / 2)
    mesh = estimate(f, "mesh", 4, 8, optimizer="sgd", device="cuda", mesh={"dp_shard": 2, "tp": 2})
    fsdp = estimate(f, "fsdp", 2, 8, optimizer="sgd", device="cuda")
    assert mesh.parts[forward] < fsdp.parts[forward]
    # checkpointing keeps the block inputs, whole on every rank (the one block recomputed: an upper bound)
    kept = [estimate(f, "tensor", n, 8, optimizer="sgd", device="cuda", checkpointing=True) for n in (1, 2)]
    assert kept[0].parts.get(forward) == kept[1].parts.get(forward)


def test_measure_never_allocates_the_model():
    # 4 * 16384^2 parameters: 4 GiB if it were built for real
    f = measure_model(lambda: nn.Sequential(*[nn.Linear(16384, 16384, bias=False) for _ in range(4)]),
                      lambda k: torch.randn(k, 16384))
    assert f.params == 4 * 16384**2


def test_cli_prints_the_table_and_what_fits():
    r = run_cli(["estimate", "--model", "resnet20", "--dataset", "synthetic", "--world-sizes", "1,2",
                 "--strategies", "single,ddp,fsdp", "--checkpointing", "--offload", "--memory", "0.1"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "peak MiB per rank" in r.stdout and "fsdp      2" in r.stdout
    assert "fits in 0.1 GiB per rank:" in r.stdout
    bad = run_cli(["estimate", "--strategies", "zero"], timeout=60)
    assert bad.returncode == 2 and "strategy 'zero' is unknown" in bad.stderr


def test_a_mesh_of_one_dimension_is_its_strategy():
    """``estimate(mesh=...)`` composes the strategies' formulas: one dimension alone is the strategy it is a
    shorthand for (dp_replicate: FSDP2's replication, without DDP's gradient buckets)."""
    f = facts()
    for mesh, strategy, world in (({"dp_shard": 4}, "fsdp", 4), ({"pp": 2}, "pipeline", 2), ({"tp": 2}, "tensor", 2)):
        for device in ("cpu", "cuda"):
            a = estimate(f, "mesh", world, 4, optimizer="adamw", device=device, mesh=mesh)
            b = estimate(f, strategy, world, 4, optimizer="adamw", device=device)
            assert a.parts == b.parts, (mesh, device)
    ddp = estimate(f, "ddp", 2, 4, optimizer="adamw")
    replicas = estimate(f, "mesh", 2, 4, optimizer="adamw", mesh={"dp_replicate": 2})
    assert replicas.training == ddp.training - ddp.parts["gradient buckets"]


def test_composed_layouts_by_hand():
    f = facts()
    # HSDP 2x2 shards within a replica: fsdp over 2 per rank
    hsdp = estimate(f, "mesh", 4, 4, optimizer="sgd", mesh={"dp_replicate": 2, "dp_shard": 2})
    assert hsdp.parts == estimate(f, "fsdp", 2, 4, optimizer="sgd").parts
    # pp2 x dp_shard2: the largest stage (600 of 1000) sharded over 2; blocks in flight whole (tp 1)
    pp_fsdp = estimate(f, "mesh", 4, 1, optimizer="sgd", device="cuda", mesh={"pp": 2, "dp_shard": 2})
    static = 600 / 2 * 4
    forward = (50 * 0.6 + 2 * 10) + (100 + 2 * 300) * 4
    step = 600 / 2 * 4 + (100 + 300) * 8
    assert pp_fsdp.training == pytest.approx(static + max(forward, step))
    # pp2 x tp2: the stage's share of the split Linears (800 * 0.6) halved
    pp_tp = estimate(f, "mesh", 4, 1, optimizer="sgd", device="cuda", mesh={"pp": 2, "tp": 2})
    local = 600 - 480 + 240
    assert pp_tp.training == pytest.approx(local * 4 + max(50 * 0.6 + 20, local * 4))
    with pytest.raises(ValueError, match="makes 4 processes, not the world size 8"):
        estimate(f, "mesh", 8, 1, mesh={"pp": 2, "tp": 2})
    with pytest.raises(ValueError, match="measured for pipelines of \\[2\\] stages, not 4"):
        estimate(facts(stage_params={2: 600}), "mesh", 4, 1, mesh={"pp": 4})


def test_cli_estimates_a_mesh_at_each_world_it_fits():
    r = run_cli(["estimate", "--model", "transformer", "--mesh", "pp=2,dp_shard=2", "--mesh", "dp_shard=-1,tp=2",
                 "--world-sizes", "4,8", "--device", "cpu"], timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line.split()[:2] for line in r.stdout.splitlines()]
    assert ["pp=2,dp_shard=2", "4"] in rows and ["dp_shard=2,tp=2", "4"] in rows and ["dp_shard=4,tp=2", "8"] in rows
    assert not any(row[0] == "ddp" for row in rows if row)  # the meshes only, unless --strategies is given
    bad = run_cli(["estimate", "--mesh", "pp=3,dp_shard=1", "--world-sizes", "2,4"], timeout=60)
    assert bad.returncode != 0 and "fits none of the world sizes" in bad.stderr
    v = run_cli(["estimate", "--model", "transformer", "--mesh", "pp=2", "--schedule", "ScheduleZBVZeroBubble",
                 "--device", "cpu"], timeout=120)  # two stages a rank, in a V
    assert v.returncode == 0 and "pp=2" in v.stdout, v.stderr
    bad = run_cli(["estimate", "--mesh", "pp=2", "--schedule", "dualpipev", "--stages-per-rank", "3"], timeout=60)
    assert bad.returncode != 0 and "it places exactly 2 stages a rank" in bad.stderr, bad.stderr
