"""pipeline: one stage per process (GPipe, 1F1B over gloo) == a plain one-process PyTorch loop."""

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

N, GLOBAL_BATCH, SEED, LR = 96, 16, 5, 0.05  # one epoch = 6 optimizer steps
N_EVAL = 37  # eval batches of 16, 16, 5: a shape the training stages never saw


def make_data(n=N, shape=(12,), seed=123):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, 4, (n,), generator=g)


def make_mlp():
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def make_transformer():
    return build_model("transformer", (1, 6, 6), 4)


def reference(make_model, data, accumulation=1, clip=None):
    """Plain PyTorch, one process, one epoch; returns (state, loss of each optimizer step)."""
    x, y = data
    torch.manual_seed(SEED)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED * 1_000_003 + 0))  # epoch 0
    micro, losses = GLOBAL_BATCH // accumulation, []
    for s in range(len(x) // GLOBAL_BATCH):
        idx = perm[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]
        opt.zero_grad()
        step_loss = 0.0
        for a in range(accumulation):
            i = idx[a * micro:(a + 1) * micro]
            loss = nn.functional.cross_entropy(model(x[i]), y[i])
            (loss / accumulation).backward()
            step_loss += loss.item() / accumulation
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(step_loss)
    return {k: v.clone() for k, v in model.state_dict().items()}, losses


def pipeline_worker(local_rank, schedule, accumulation=None, clip=None):
    pt = paratrain.Parallel(strategy="pipeline", global_batch=GLOBAL_BATCH, seed=SEED, accumulation=accumulation,
                            clip_grad_norm=clip, pipeline={"schedule": schedule, "n_microbatches": 4})
    assert pt.strategy.data_parallel_size == 1 and pt.plan.micro_batch == GLOBAL_BATCH // (accumulation or 1)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, opt = pt.setup(model, opt)
    loader = pt.train_loader(TensorDataset(*make_data()))
    losses, step_loss = [], 0.0
    for xb, yb in loader:
        opt.zero_grad()
        loss = pt.training_step(model, (xb, yb), nn.functional.cross_entropy)
        step_loss += loss.item() / pt.accumulation
        opt.step()
        if pt.micro_step == 0:
            losses.append(step_loss)
            step_loss = 0.0
    assert pt.global_step == N // GLOBAL_BATCH
    stage_keys = sorted(pt.strategy.unwrap(model).state_dict())
    state = pt.strategy.full_state_dict(model)
    pt.close()
    return state, losses, stage_keys


def assert_close_states(got, ref, rtol=1e-5):
    assert list(got) == list(ref)
    for k in ref:
        err = ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item()
        assert err <= rtol, f"{k}: relative error {err:.2e} > {rtol}"


@pytest.mark.parametrize("schedule,world", [("gpipe", 2), ("1f1b", 2), ("gpipe", 1)])
def test_pipeline_matches_single_process_reference(schedule, world):
    ref_state, ref_losses = reference(make_mlp, make_data())
    results = paratrain.launch(pipeline_worker, nprocs=world, args=(schedule,), timeout=90)
    for state, losses, _ in results:  # every rank gathers the whole trained model and the same losses
        assert_close_states(state, ref_state)
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    if world == 2:  # 7 layers balanced by parameters: (Linear, ReLU, Linear) | (ReLU, Linear, ReLU, Linear)
        assert results[0][2] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert results[1][2] == ["4.bias", "4.weight", "6.bias", "6.weight"]


def test_pipeline_accumulation_and_clipping():
    # Clipping uses the norm of the whole model's gradient, summed over the stages.
    ref_state, ref_losses = reference(make_mlp, make_data(), accumulation=2, clip=0.05)
    results = paratrain.launch(pipeline_worker, nprocs=2, args=("1f1b", 2, 0.05), timeout=90)
    for state, losses, _ in results:
        assert_close_states(state, ref_state)
        assert losses == pytest.approx(ref_losses, rel=1e-5)


def fit_worker(local_rank):
    pt = paratrain.Parallel(strategy="pipeline", global_batch=GLOBAL_BATCH, seed=SEED,
                            pipeline={"schedule": "1f1b", "n_microbatches": 2, "split_points": ["block1"]})
    model = make_transformer()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, opt = pt.setup(model, opt)
    train = TensorDataset(*make_data(shape=(1, 6, 6)))
    evalset = TensorDataset(*make_data(N_EVAL, (1, 6, 6), seed=7))
    result = fit(pt, model, opt, train, epochs=1, eval_set=evalset, progress_bar=False)
    state = pt.strategy.full_state_dict(model)
    pt.close()
    return result, state


def test_fit_with_eval_on_a_transformer():
    ref_state, ref_losses = reference(make_transformer, make_data(shape=(1, 6, 6)))
    ref_model = make_transformer()
    ref_model.load_state_dict(ref_state)
    ref_model.eval()
    with torch.no_grad():
        x, y = make_data(N_EVAL, (1, 6, 6), seed=7)
        out = ref_model(x)
    ref_eval_loss = nn.functional.cross_entropy(out, y).item()
    ref_accuracy = (out.argmax(1) == y).float().mean().item()
    results = paratrain.launch(fit_worker, nprocs=2, timeout=90)
    for result, state in results:
        assert result.steps == N // GLOBAL_BATCH
        assert result.eval["count"] == N_EVAL  # every sample once, on every rank
        assert result.eval["loss"] == pytest.approx(ref_eval_loss, rel=1e-4)
        assert result.eval["accuracy"] == pytest.approx(ref_accuracy)
        assert result.train_loss == pytest.approx(sum(ref_losses) / len(ref_losses), rel=1e-5)
        assert_close_states(state, ref_state, rtol=1e-4)


def ckpt_worker(local_rank, strategy, ckpt_dir, stop_at):
    """Train epoch 0 with momentum SGD, checkpointing every 2 steps; stop after ``stop_at`` steps,
    or (``stop_at=None``) resume from the newest checkpoint and finish the epoch."""
    options = {"pipeline": {"schedule": "1f1b", "n_microbatches": 4}} if strategy == "pipeline" else {}
    pt = paratrain.Parallel(strategy=strategy, global_batch=GLOBAL_BATCH, seed=SEED, **options)
    model = make_mlp()
    # Two groups (same settings as the reference's one): on the second stage the first is empty.
    rest = [p for i in (2, 4, 6) for p in model[i].parameters()]
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": rest}], lr=LR, momentum=0.9)
    model, opt = pt.setup(model, opt)
    if stop_at is None:
        pt.load_checkpoint(ckpt_dir, model, opt)
    resumed_at = pt.global_step
    loader = pt.train_loader(TensorDataset(*make_data()))
    for xb, yb in loader:
        if pt.global_step == (stop_at or N // GLOBAL_BATCH):
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
    ref_state, _ = reference(make_mlp, make_data())
    ckpt = str(tmp_path / "ckpt")
    paratrain.launch(ckpt_worker, nprocs=2, args=("pipeline", ckpt, 3), timeout=90)
    assert (tmp_path / "ckpt" / "step-00000002.dcp" / ".metadata").is_file()
    for strategy, world in (("pipeline", 2), ("single", 1)):
        again = shutil.copytree(ckpt, tmp_path / strategy)  # the resumed run writes its own checkpoints
        outs = paratrain.launch(ckpt_worker, nprocs=world, args=(strategy, str(again), None), timeout=90)
        assert [m for _, _, m in outs] == ([4, 4] if world == 2 else [8])
        for state, resumed_at, _ in outs:
            assert resumed_at == 2
            assert_close_states(state, ref_state)


def bad_worker(local_rank):
    """Errors raised on every rank alike, before any collective: each returns its messages."""
    errors = []
    pt = paratrain.Parallel(strategy="pipeline", global_batch=GLOBAL_BATCH, pipeline={"split_points": ["nope"]})
    for make in (lambda: nn.Sequential(nn.Linear(12, 4)), make_mlp):  # 2 stages > 1 layer; unknown split point
        try:
            pt.setup(make())
        except ValueError as e:
            errors.append(str(e))
    pt = paratrain.Parallel(strategy="pipeline", global_batch=GLOBAL_BATCH)  # joins the same process group
    model = pt.setup(make_mlp())
    x, y = make_data(6)
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
