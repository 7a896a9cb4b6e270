"""tensor (DTensor tensor parallelism, alone and with FSDP on a 2-D mesh) == a plain one-process loop."""

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.strategies.tensor import TensorOptions, auto_plan
from parity import Problem, Stack, assert_same_state, mlp, run_paratrain, teacher_data

N = 64
# 5 steps (crossing into epoch 2). Measured on the float32 reference (tests/test_parity_conditioning.py):
# 1 vs 2 threads and float32 vs float64 <= 3e-7 (so 1e-5, >= 10x).
COMMON = dict(global_batch=16, steps=5, seed=11, lr=0.05, momentum=0.9, rtol=1e-5)
MLP = Problem(functools.partial(mlp, 36, 32, 16, 4, flatten=True), functools.partial(teacher_data, N, (6, 6), seed=3),
              **COMMON)
STACK = Problem(Stack, functools.partial(teacher_data, N, (5, 12), seed=3), clip=0.5, **COMMON)  # sequences of 5 x 12
STACK_2D = STACK.replace(accumulation=2)  # dp 2 x tp 2: the dp ranks' shares of each batch
PROBLEMS = {"mlp": MLP, "stack, clip": STACK, "stack, clip, accumulation 2": STACK_2D}


def reference(problem):
    """The one-process reference, and its loss over the whole data set (what evaluate computes)."""
    trained = problem.reference()
    x, y = problem.data()
    with torch.no_grad():
        eval_loss = nn.functional.cross_entropy(trained.model(x), y).item()
    return trained.state, eval_loss


def tp_run(problem, tp_size=None):
    def after(pt, model, opt):
        dataset = TensorDataset(*problem.data())
        xb = dataset.tensors[0][:5]
        out = model(xb)
        assert type(out) is torch.Tensor and out.shape == (len(xb), 4)  # full, replicated logits
        return {"eval": pt.evaluate(model, pt.eval_loader(dataset, batch_size=8)),
                "dp": (pt.strategy.data_parallel_size, pt.strategy.data_parallel_rank, pt.plan.world_size)}

    run = run_paratrain(problem, "tensor", tensor={"tp_size": tp_size}, after=after)
    return {**run, "first_batch": run["first_inputs"]}


def error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def bad_combinations():
    """The one-line errors, from inside a real world of 2."""
    def setup(model, **tensor):
        pt = paratrain.Parallel(strategy="tensor", global_batch=MLP.global_batch, tensor=tensor)
        pt.setup(model)

    return {
        "indivisible world": error_of(lambda: setup(MLP.model(), tp_size=3)),
        "no linear": error_of(lambda: setup(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten()))),
        "odd features": error_of(lambda: setup(nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 2)))),
        "not a linear": error_of(lambda: setup(nn.Sequential(nn.Linear(8, 4), nn.ReLU()), plan={"1": "colwise"})),
    }


def tp_worker(rank, runs, check_errors):
    out = [tp_run(*run) for run in runs]  # one launch, several runs: starting processes is the slow part
    errors = bad_combinations() if check_errors else None
    paratrain.destroy()
    return out, errors


def test_tensor_parallel_matches_reference_and_errors_are_one_line():
    problems = [MLP, STACK]
    outs = paratrain.launch(tp_worker, nprocs=2, args=([(p,) for p in problems], True), timeout=90)
    refs = [reference(p) for p in problems]
    for results, _ in outs:
        for got, (ref, ref_eval), p in zip(results, refs, problems):
            assert_same_state(got["state"], ref, p.rtol)
            # the loss is a smooth function of the weights: their tolerance
            assert got["eval"]["count"] == N and got["eval"]["loss"] == pytest.approx(ref_eval, rel=p.rtol)
            assert got["dp"] == (1, 0, 1)  # both ranks split the same batch
    errors = outs[0][1]
    assert errors == outs[1][1]
    assert errors["indivisible world"] == (
        "tensor: world size 2 is not divisible by tp_size 3: use a tp_size that divides 2")
    assert errors["no linear"].startswith("tensor: the model (Sequential) has no nn.Linear layer to parallelize")
    assert errors["odd features"] == "tensor: Linear '0' (colwise) has out_features 5, not divisible by tp_size 2"
    assert errors["not a linear"] == "tensor plan names '1', which is not an nn.Linear of the model"
    assert all("\n" not in e for e in errors.values())


def test_tensor_2d_mesh_dp2_tp2_matches_reference():
    p = STACK_2D
    outs = paratrain.launch(tp_worker, nprocs=4, args=([(p, 2)], False), timeout=120)
    ref, ref_eval = reference(p)
    for rank, ((got,), _) in enumerate(outs):
        assert_same_state(got["state"], ref, p.rtol)
        # the sampler shards over dp only: 2 data-parallel ranks, tp ranks 0,1 (and 2,3) share a batch
        assert got["dp"] == (2, rank // 2, 2)
        assert got["eval"]["count"] == N and got["eval"]["loss"] == pytest.approx(ref_eval, rel=p.rtol)
    batches = [o[0][0]["first_batch"] for o in outs]
    assert torch.equal(batches[0], batches[1]) and torch.equal(batches[2], batches[3])
    assert not torch.equal(batches[0], batches[2])


def test_auto_plan_pairs_linears_around_activations():
    assert auto_plan(MLP.model()) == {"1": "colwise", "3": "rowwise"}
    pairs = (("fc1", "colwise"), ("fc2", "rowwise"))
    assert auto_plan(Stack()) == {f"blocks.{i}.{name}": style for i in (0, 1) for name, style in pairs}


def test_tensor_options_validate():
    assert TensorOptions(plan="a=colwise, b=rowwise").plan == {"a": "colwise", "b": "rowwise"}
    with pytest.raises(ValueError, match="tp_size 0 must be at least 1"):
        TensorOptions(tp_size=0)
    with pytest.raises(ValueError, match="'diagonal' is unknown"):
        TensorOptions(plan={"fc": "diagonal"})
    cfg = paratrain.ParallelConfig(strategy="tensor", tensor={"tp_size": "2"})
    assert cfg.tensor == TensorOptions(tp_size=2)
