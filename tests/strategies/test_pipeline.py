"""pipeline: one stage per process (GPipe, 1F1B over gloo) == a plain one-process PyTorch loop."""

import functools
import shutil

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.config import ParallelConfig
from paratrain.loop.fit import fit
from paratrain.models import build_model
from paratrain.strategies._split import balanced_cuts, check_sequential, split_model
from paratrain.strategies.pipeline import PipelineOptions
from parity import Problem, assert_same_state, mlp, run_workers, teacher_data

N = 96  # GLOBAL_BATCH 16: one epoch = 6 optimizer steps
N_EVAL = 37  # eval batches of 16, 16, 5: a shape the training stages never saw
make_mlp = functools.partial(mlp, 12, 16, 16, 16, 4)  # 7 layers: Linear, act, Linear, act, Linear, act, Linear
make_data = functools.partial(teacher_data, N, (12,), seed=123)


def make_transformer():
    return build_model("transformer", (1, 6, 6), 4)


# One epoch. Measured on the float32 reference (tests/test_parity_conditioning.py): 1 vs 2 threads
# and float32 vs float64 <= 2.5e-7 for the mlp, <= 4.5e-7 for the transformer (attention and
# LayerNorm), so 1e-5 is >= 20x both. (Pipeline vs reference measured 1.5e-7 and 4e-7.)
COMMON = dict(global_batch=16, steps=N // 16, seed=5, lr=0.05, momentum=0.9, rtol=1e-5)
MLP = Problem(make_mlp, make_data, **COMMON)
TRANSFORMER = Problem(make_transformer, functools.partial(teacher_data, N, (1, 6, 6), seed=123), **COMMON)
MLP_ACCUMULATED = MLP.replace(accumulation=2, clip=0.05)  # clip 0.05: below the gradient norm, so it acts
PROBLEMS = {"mlp": MLP, "transformer": TRANSFORMER, "mlp, accumulation 2, clip": MLP_ACCUMULATED}


def one_replica(pt, model, opt):
    assert pt.strategy.data_parallel_size == 1 and pt.plan.micro_batch == pt.global_batch // pt.accumulation


def stage_keys(pt, model, opt):
    return {"stage_keys": sorted(pt.strategy.unwrap(model).state_dict())}


def pipeline_runs(schedule, problem, world):
    """Every rank's (state, losses, its stage's keys) after training ``problem`` on ``world`` stages."""
    options = {"pipeline": {"schedule": schedule, "n_microbatches": 4}, "before": one_replica, "after": stage_keys}
    return [(run["state"], run["losses"], run["stage_keys"])
            for (run,) in run_workers(world, (problem, "pipeline", options))]


def assert_same_pipeline_state(got, ref, rtol):
    assert list(got) == list(ref)  # gathered from the stages in the model's own key order
    assert_same_state(got, ref, rtol)


@pytest.mark.parametrize("schedule,world", [("gpipe", 2), ("1f1b", 2), ("gpipe", 1), ("interleaved1f1b", 2),
                                             ("loopedbfs", 1)])
def test_pipeline_matches_single_process_reference(schedule, world):
    ref = MLP.reference()
    results = pipeline_runs(schedule, MLP, world)
    for state, losses, _ in results:  # every rank gathers the whole trained model and the same losses
        assert_same_pipeline_state(state, ref.state, MLP.rtol)
        assert losses == pytest.approx(ref.losses, rel=MLP.rtol)  # functions of the weights: their rtol (measured 9e-8)
    if world == 2 and schedule in ("gpipe", "1f1b"):  # 7 layers by parameters: (Linear, act, Linear) | (act, Linear, ...)
        assert results[0][2] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert results[1][2] == ["4.bias", "4.weight", "6.bias", "6.weight"]
    elif world == 2:  # 4 stages, 2 a rank: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
        assert results[0][2] == ["0.bias", "0.weight", "4.bias", "4.weight"]
        assert results[1][2] == ["2.bias", "2.weight", "6.bias", "6.weight"]


def test_pipeline_accumulation_and_clipping():
    # Clipping uses the norm of the whole model's gradient, summed over the stages.
    p = MLP_ACCUMULATED
    ref = p.reference()
    results = pipeline_runs("1f1b", p, 2)
    for state, losses, _ in results:
        assert_same_pipeline_state(state, ref.state, p.rtol)
        assert losses == pytest.approx(ref.losses, rel=p.rtol)


def eval_data():
    return teacher_data(N_EVAL, (1, 6, 6), seed=7)  # the training set's teacher, other samples


def fit_worker(local_rank):
    p = TRANSFORMER
    pt = paratrain.Parallel(strategy="pipeline", global_batch=p.global_batch, seed=p.seed,
                            pipeline={"schedule": "1f1b", "n_microbatches": 2, "split_points": ["block1"]})
    model = p.model()
    opt = p.optimizer(model.parameters())
    model, opt = pt.setup(model, opt)
    train = TensorDataset(*p.data())
    evalset = TensorDataset(*eval_data())
    result = fit(pt, model, opt, train, epochs=1, eval_set=evalset, progress_bar=False)
    state = pt.strategy.full_state_dict(model)
    pt.close()
    return result, state


def test_fit_with_eval_on_a_transformer():
    p = TRANSFORMER
    ref = p.reference()
    ref_model = ref.model.eval()
    with torch.no_grad():
        x, y = eval_data()
        out = ref_model(x)
    ref_eval_loss = nn.functional.cross_entropy(out, y).item()
    ref_accuracy = (out.argmax(1) == y).float().mean().item()
    results = paratrain.launch(fit_worker, nprocs=2, timeout=90)
    for result, state in results:
        assert result.steps == p.steps
        assert result.eval["count"] == N_EVAL  # every sample once, on every rank
        assert result.eval["loss"] == pytest.approx(ref_eval_loss, rel=p.rtol)  # a function of the weights: their rtol
        # argmax hits: exact, the closest eval sample's top two logits are 1.3e-3 apart (1000x
        # what the weights' 4e-7 difference can move them)
        assert result.eval["accuracy"] == pytest.approx(ref_accuracy)
        # the mean of the 6 step losses: a function of the weights, their rtol (measured 1.4e-8)
        assert result.train_loss == pytest.approx(sum(ref.losses) / len(ref.losses), rel=p.rtol)
        assert_same_pipeline_state(state, ref.state, p.rtol)


def ckpt_worker(local_rank, strategy, ckpt_dir, stop_at):
    """Train epoch 0 with momentum SGD, checkpointing every 2 steps; stop after ``stop_at`` steps,
    or (``stop_at=None``) resume from the newest checkpoint and finish the epoch."""
    options = {"pipeline": {"schedule": "1f1b", "n_microbatches": 4}} if strategy == "pipeline" else {}
    pt = paratrain.Parallel(strategy=strategy, global_batch=MLP.global_batch, seed=MLP.seed, **options)
    model = MLP.model()
    # Two groups (same settings as the reference's one): on the second stage the first is empty.
    rest = [p for i in (2, 4, 6) for p in model[i].parameters()]
    opt = MLP.optimizer([{"params": model[0].parameters()}, {"params": rest}])
    model, opt = pt.setup(model, opt)
    if stop_at is None:
        pt.load_checkpoint(ckpt_dir, model, opt)
    resumed_at = pt.global_step
    loader = pt.train_loader(TensorDataset(*MLP.data()))
    for xb, yb in loader:
        if pt.global_step == (stop_at or MLP.steps):
            break
        opt.zero_grad()
        pt.training_step(model, (xb, yb), nn.functional.cross_entropy)
        opt.step()
        if pt.global_step % 2 == 0:
            pt.save_checkpoint(ckpt_dir, model, opt)
    state = pt.full_state_dict(model)
    momentum = len(opt.state)  # restored for every parameter this rank trains
    pt.close()
    return state, resumed_at, momentum


def test_pipeline_checkpoint_resumes_on_pipeline_and_single(tmp_path):
    # Stages write their own parameters and momentum through DCP; a 2-stage run stopped after
    # 3 steps resumes from step 2 as a pipeline again and as a single process, and both end
    # where the uninterrupted one-process loop ends.
    ref = MLP.reference()
    ckpt = str(tmp_path / "ckpt")
    paratrain.launch(ckpt_worker, nprocs=2, args=("pipeline", ckpt, 3), timeout=90)
    assert (tmp_path / "ckpt" / "step-00000002.dcp" / ".metadata").is_file()
    for strategy, world in (("pipeline", 2), ("single", 1)):
        again = shutil.copytree(ckpt, tmp_path / strategy)  # the resumed run writes its own checkpoints
        outs = paratrain.launch(ckpt_worker, nprocs=world, args=(strategy, str(again), None), timeout=90)
        assert [m for _, _, m in outs] == ([4, 4] if world == 2 else [8])
        for state, resumed_at, _ in outs:
            assert resumed_at == 2
            assert_same_pipeline_state(state, ref.state, MLP.rtol)


def bad_worker(local_rank):
    """Errors raised on every rank alike, before any collective: each returns its messages."""
    errors = []
    pt = paratrain.Parallel(strategy="pipeline", global_batch=MLP.global_batch, pipeline={"split_points": ["nope"]})
    for make in (lambda: nn.Sequential(nn.Linear(12, 4)), make_mlp):  # 2 stages > 1 layer; unknown split point
        try:
            pt.setup(make())
        except ValueError as e:
            errors.append(str(e))
    pt = paratrain.Parallel(strategy="pipeline", global_batch=MLP.global_batch)  # joins the same process group
    model = pt.setup(make_mlp())
    x, y = teacher_data(6)
    try:  # a batch the schedule cannot cut into 4 micro-batches
        pt.training_step(model, (x, y))
    except ValueError as e:
        errors.append(str(e))
    try:
        model(x)
    except RuntimeError as e:
        errors.append(str(e))
    pt.close()
    return errors


def test_bad_combinations_fail_with_one_line():
    errors = paratrain.launch(bad_worker, nprocs=2, timeout=60)
    assert errors[0] == errors[1] and len(errors[0]) == 4
    layers, split, batch, forward = errors[0]
    assert "pipeline: 2 stages (processes) but Sequential has only 1 top-level layers (0): use fewer processes" in layers
    assert "split point 'nope' is not a top-level child of Sequential: children are 0, 1, 2, 3, 4, 5, 6" in split
    assert "batch of 6 samples is not divisible by n_microbatches=4" in batch
    assert "pt.training_step" in forward
    assert all("\n" not in e for e in errors[0])


def test_config_errors():
    with pytest.raises(ValueError, match="n_microbatches=4 does not divide the batch of 10 samples") as e:
        ParallelConfig(strategy="pipeline", global_batch=10, pipeline={"n_microbatches": 4})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="batch of 4 samples per step"):  # 16 / accumulation 4
        ParallelConfig(strategy="pipeline", global_batch=16, accumulation=4, pipeline={"n_microbatches": 3})
    with pytest.raises(ValueError, match="fp16-mixed is not supported with strategy pipeline"):
        ParallelConfig(strategy="pipeline", precision="fp16-mixed")
    with pytest.raises(ValueError, match="schedule 'zb' is unknown"):
        PipelineOptions(schedule="zb")
    with pytest.raises(ValueError, match="n_microbatches 0"):
        PipelineOptions(n_microbatches=0)
    # torch's class names, any case, as torchtitan takes them; two stages a rank unless told
    assert (PipelineOptions(schedule="ScheduleInterleaved1F1B").schedule, PipelineOptions(schedule="Interleaved1F1B")
            .stages_per_rank, PipelineOptions(schedule="interleaved_zero_bubble").schedule) == (
        "interleaved1f1b", 2, "interleavedzerobubble")
    assert PipelineOptions(schedule="loopedbfs", stages_per_rank=3).stages_per_rank == 3
    with pytest.raises(ValueError, match="stages_per_rank=2 with schedule 1f1b: use one of interleaved1f1b, loopedbfs, "
                                         "interleavedzerobubble, zbvzerobubble, dualpipev for several stages a rank"):
        PipelineOptions(schedule="1f1b", stages_per_rank=2)
    assert PipelineOptions(schedule="ScheduleZBVZeroBubble").stages_per_rank == 2  # a V: exactly two a rank
    with pytest.raises(ValueError, match="stages_per_rank=3 with schedule dualpipev: it places exactly 2 stages a rank"):
        PipelineOptions(schedule="DualPipeV", stages_per_rank=3)


def test_stage_placement_is_torchs():
    """Which pipeline rank holds which stage: torch's own mapping, looped or in a V (one owner: the schedules use it)."""
    from paratrain.strategies._stages import stage_ranks

    assert stage_ranks("gpipe", 4, 4) == [0, 1, 2, 3]
    assert stage_ranks("interleaved1f1b", 2, 6) == [0, 1, 0, 1, 0, 1]
    assert stage_ranks("zbvzerobubble", 3, 6) == [0, 1, 2, 2, 1, 0]
    assert PipelineOptions(split_points="block1,head").split_points == ["block1", "head"]  # command line
    with pytest.raises(ValueError, match="name a child twice"):
        PipelineOptions(split_points=["a", "a"])


def test_split_helper():
    assert balanced_cuts([1, 100, 1, 100], 2) == [2]
    assert balanced_cuts([5, 5, 5, 5, 5, 5], 3) == [2, 4]
    model = make_mlp()
    parts = split_model(model, 3, ["2", "4"])
    assert [list(p._modules) for p in parts] == [["0", "1"], ["2", "3"], ["4", "5", "6"]]
    assert parts[1][0] is model[2]  # shared, not copied
    with pytest.raises(ValueError, match="must name children in forward order"):
        split_model(model, 3, ["4", "2"])
    with pytest.raises(ValueError, match="give 1 split points"):
        split_model(model, 2, ["2", "4"])
    # A forward that is not its children in order (here a skip connection) is refused.
    skip = _Skip()
    with pytest.raises(ValueError, match=r"_Skip.forward is not its top-level children called in order \(fc1, fc2\)"):
        check_sequential(skip, split_model(skip, 2), torch.randn(3, 4), "pipeline")


class _Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.fc2(self.fc1(x)) + x


def test_batchnorm_under_micro_batches_is_said_once_at_setup():
    """BatchNorm normalises each of the n_microbatches chunks on its own: setup warns (a world of one)."""
    import warnings

    import paratrain

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pt = paratrain.Parallel(strategy="pipeline", global_batch=8)
        pt.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)))
        pt.close()
    assert [str(w.message) for w in caught if "BatchNorm" in str(w.message)] == [
        "pipeline n_microbatches=4: BatchNorm normalises each micro-batch on its own (and updates its running statistics "
        "once per micro-batch), not the whole batch; n_microbatches=1 keeps the one-process numerics but runs the "
        "stages one after another"]


def _one_micro_batch_for_two_stages(local_rank):
    pt = paratrain.Parallel(strategy="pipeline", global_batch=4, pipeline={"schedule": "1f1b", "n_microbatches": 1})
    try:
        pt.setup(MLP.model())
    except ValueError as e:
        return str(e)
    finally:
        pt.close(wait_for_peers=False)
    return None


def test_1f1b_with_fewer_micro_batches_than_stages_is_one_line_at_setup():
    out = paratrain.launch(_one_micro_batch_for_two_stages, 2, timeout=60)
    assert out == ["pipeline schedule 1f1b needs at least one micro-batch per stage: n_microbatches=1 < 2 stages; "
                   "set n_microbatches >= 2, or schedule gpipe"] * 2


def test_micro_batches_an_interleaved_schedule_cannot_run_in_rounds_are_one_line_at_setup():
    """Checked before anything is cut or sent: rank 1 of 2, no process group needed."""
    from paratrain.env.base import ProcessInfo
    from paratrain.env.process import Dist
    from paratrain.strategies.pipeline import PipelineStrategy

    rank1 = Dist(ProcessInfo(rank=1, world_size=2, local_rank=1, local_world_size=2), torch.device("cpu"), "gloo")
    strategy = PipelineStrategy(rank1, options=PipelineOptions(schedule="interleaved1f1b", n_microbatches=5))
    with pytest.raises(ValueError) as e:
        strategy.setup_model(MLP.model())
    assert str(e.value) == ("pipeline schedule interleaved1f1b runs micro-batches in rounds of 2 (the pipeline ranks): "
                            "n_microbatches=5 is not a multiple of its 2 rounds; use a multiple of 2")
    dualpipe = PipelineStrategy(rank1, options=PipelineOptions(schedule="dualpipev", n_microbatches=2))
    with pytest.raises(ValueError) as e:
        dualpipe.setup_model(MLP.model())
    assert str(e.value) == ("pipeline schedule dualpipev needs at least one micro-batch per stage: n_microbatches=2 < 4 "
                            "stages (2 a rank); set n_microbatches >= 4, or schedule zbvzerobubble")


def test_a_weight_two_stages_of_a_rank_share_is_found_on_that_rank_only():
    """ZBV places nanoGPT's tied embedding (stage 0) and head (stage 3) on pipeline rank 0, which keeps that weight
    whole beside data-parallel replicas (tests/strategies/test_mesh_pipeline.py trains it); rank 1, and every rank
    under InterleavedZeroBubble (the ends on two ranks), share nothing."""
    import zoo

    from paratrain.env.base import ProcessInfo
    from paratrain.env.process import Dist
    from paratrain.strategies.pipeline import PipelineParts, PipelineStrategy, cut_stages

    model = zoo.GPT(n_layer=4)
    for schedule, rank, tied in (("zbvzerobubble", 0, [model.transformer.wte.weight]), ("zbvzerobubble", 3, []),
                                 ("interleavedzerobubble", 0, [])):
        info = Dist(ProcessInfo(rank=rank, world_size=4, local_rank=rank, local_world_size=4), torch.device("cpu"), "gloo")
        strategy = PipelineStrategy(info, options=PipelineParts(PipelineOptions(schedule=schedule, stages_per_rank=2)),
                                    layout={"pp": 2, "dp_shard": 2})
        parts = cut_stages(model, 4, placement=strategy.placement)
        mine = [s for s, q in enumerate(strategy.placement) if q == strategy.stage_index]
        assert strategy._ties_within_the_rank(parts, mine) == tied, (schedule, rank)
