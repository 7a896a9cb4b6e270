"""Global-batch sampling: exact coverage, world-size-invariant order, exact resume (pure, no processes)."""

import pytest
import torch

from paratrain.data.sampler import BatchPlan, GlobalBatchSampler, ShardedEvalSampler


def make_samplers(n, global_batch, world, accumulation=1, seed=0):
    plan = BatchPlan.derive(global_batch, world, accumulation)
    return [GlobalBatchSampler(n, plan, rank=r, seed=seed) for r in range(world)]


def global_steps(samplers, epoch=0, start_step=0):
    """Per optimizer step, per micro-step, the ranks' micro-batches: steps[s][a][r] -> list of indices."""
    acc = samplers[0].plan.accumulation
    per_rank = [list(s.micro_batches(epoch, start_step)) for s in samplers]
    n_micro = len(per_rank[0])
    assert all(len(b) == n_micro for b in per_rank)
    assert n_micro % acc == 0
    return [
        [[per_rank[r][s * acc + a] for r in range(len(samplers))] for a in range(acc)]
        for s in range(n_micro // acc)
    ]


def concat(micro_step):
    return [i for rank_batch in micro_step for i in rank_batch]


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_index_once_per_epoch(world, accumulation):
    global_batch = 24  # divisible by 1..4 x 1..2
    n = 4 * global_batch
    samplers = make_samplers(n, global_batch, world, accumulation, seed=7)
    micro = global_batch // (world * accumulation)
    seen = []
    for s in samplers:
        batches = list(s)
        assert len(batches) == (n // global_batch) * accumulation
        assert all(len(b) == micro for b in batches)
        seen.extend(i for b in batches for i in b)
    assert sorted(seen) == list(range(n))


def test_order_changes_between_epochs_without_set_epoch():
    (s,) = make_samplers(48, 12, 1)
    first = [i for b in s for i in b]
    second = [i for b in s for i in b]
    assert sorted(first) == sorted(second) == list(range(48))
    assert first != second
    assert s.position == 2 * s.steps_per_epoch
    # Every rank advances the same way: rank 1 of a world of 2 also moves on to epoch 1.
    r0, r1 = make_samplers(48, 12, 2)
    e0 = [list(r0), list(r1)]
    e1 = [list(r0), list(r1)]
    assert e0 != e1
    assert sorted(i for bs in e1 for b in bs for i in b) == list(range(48))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_same_global_order_at_world_1_and_3(accumulation):
    n, global_batch = 60, 12
    for epoch in (0, 1):
        one = global_steps(make_samplers(n, global_batch, 1, accumulation, seed=3), epoch)
        three = global_steps(make_samplers(n, global_batch, 3, accumulation, seed=3), epoch)
        assert len(one) == len(three) == n // global_batch
        for step1, step3 in zip(one, three):
            # the optimizer step sees the same set of samples...
            assert sorted(i for m in step1 for i in concat(m)) == sorted(i for m in step3 for i in concat(m))
            # ...and each micro-step (what SyncBatchNorm sees) is the same, in rank order.
            for m1, m3 in zip(step1, step3):
                assert concat(m1) == concat(m3)
                assert len(concat(m1)) == global_batch // accumulation


@pytest.mark.parametrize("world,accumulation", [(4, 1), (3, 2), (2, 3), (1, 1)])
def test_uneven_dataset_drops_only_the_tail(world, accumulation):
    n, global_batch = 103, 12  # 103 = 8 * 12 + 7, and 103 is not divisible by 2, 3 or 4
    samplers = make_samplers(n, global_batch, world, accumulation, seed=11)
    for _epoch in range(2):
        per_rank = [list(s) for s in samplers]
        counts = {len(b) for b in per_rank}
        assert counts == {(n // global_batch) * accumulation}, "ranks must agree on the number of micro-batches"
        flat = [i for batches in per_rank for b in batches for i in b]
        assert len(flat) == len(set(flat)), "an index appeared twice"
        assert set(flat) <= set(range(n))
        assert n - len(set(flat)) == n % global_batch == 7
    # the dropped tail is the last n mod B positions of the epoch's permutation, not padding
    tails = []
    for epoch in range(2):
        flat = {i for s in samplers for b in s.micro_batches(epoch) for i in b}
        tails.append(set(range(n)) - flat)
    assert all(len(t) == 7 for t in tails)


def test_len_matches_what_iteration_yields():
    (s,) = make_samplers(50, 8, 1, accumulation=2)
    assert len(s) == (50 // 8) * 2 == len(list(s))
    s.set_position(2)
    assert len(s) == (50 // 8 - 2) * 2
    assert len(list(s)) == (50 // 8 - 2) * 2


@pytest.mark.parametrize("accumulation", [1, 2])
def test_resume_mid_epoch(accumulation):
    n, global_batch, world = 70, 12, 2  # 5 steps per epoch, 10-sample tail
    full = make_samplers(n, global_batch, world, accumulation, seed=5)
    epoch0 = [list(s) for s in full]
    epoch1 = [list(s) for s in full]
    for k in (0, 1, 3, 4):
        # set_position
        fresh = make_samplers(n, global_batch, world, accumulation, seed=5)
        for r, s in enumerate(fresh):
            s.set_position(k)
            assert s.position == k
            assert list(s) == epoch0[r][k * accumulation:]
            assert list(s) == epoch1[r], "after the resumed epoch, the next iter() is the next epoch"
        # state_dict / load_state_dict, into samplers built with another seed (the state carries it)
        src = make_samplers(n, global_batch, world, accumulation, seed=5)
        for s in src:
            s.set_position(k)
        dst = make_samplers(n, global_batch, world, accumulation, seed=99)
        for r, (a, b) in enumerate(zip(src, dst)):
            b.load_state_dict(a.state_dict())
            assert b.seed == 5 and b.position == k
            assert list(b) == epoch0[r][k * accumulation:]
    # a position inside the second epoch
    steps = full[0].steps_per_epoch
    for r in range(world):
        s = make_samplers(n, global_batch, world, accumulation, seed=5)[r]
        s.set_position(steps + 2)
        assert list(s) == epoch1[r][2 * accumulation:]


def test_state_after_a_full_epoch_points_at_the_next_epoch():
    (s,) = make_samplers(40, 8, 1, seed=1)
    list(s)
    state = s.state_dict()
    assert state == {"global_step": 5, "seed": 1, "global_batch": 8}
    (t,) = make_samplers(40, 8, 1, seed=1)
    t.load_state_dict(state)
    (ref,) = make_samplers(40, 8, 1, seed=1)
    list(ref)
    assert list(t) == list(ref)


@pytest.mark.parametrize("new_world,new_acc", [(3, 1), (2, 2), (4, 3)])
def test_resume_on_another_world_size_continues_the_same_global_batches(new_world, new_acc):
    n, global_batch = 100, 24  # 4 steps per epoch
    (one,) = make_samplers(n, global_batch, 1, seed=8)
    ref_epoch0 = global_steps([one], 0)
    ref_epoch1 = global_steps([one], 1)
    one.set_position(2)  # stopped after 2 optimizer steps of epoch 0
    state = one.state_dict()
    resumed = make_samplers(n, global_batch, new_world, new_acc, seed=0)
    for s in resumed:
        s.load_state_dict(state)
    per_rank = [list(s) for s in resumed]
    assert len({len(b) for b in per_rank}) == 1
    acc = new_acc
    n_steps = len(per_rank[0]) // acc
    assert n_steps == 2
    for step in range(n_steps):
        got = sorted(i for r in range(new_world) for b in per_rank[r][step * acc:(step + 1) * acc] for i in b)
        want = sorted(concat(ref_epoch0[2 + step][0]))
        assert got == want
    # and the epoch after is the same too
    nxt = [list(s) for s in resumed]
    for step in range(one.steps_per_epoch):
        got = sorted(i for r in range(new_world) for b in nxt[r][step * acc:(step + 1) * acc] for i in b)
        assert got == sorted(concat(ref_epoch1[step][0]))


def test_load_state_with_other_global_batch_raises():
    (a,) = make_samplers(100, 20, 1)
    (b,) = make_samplers(100, 10, 1)
    a.set_position(3)
    with pytest.raises(ValueError, match="global batch"):
        b.load_state_dict(a.state_dict())
    assert b.position == 0


# --- BatchPlan ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(global_batch=32, world_size=4), (1, 8)),
        (dict(global_batch=32, world_size=2, accumulation=4), (4, 4)),
        (dict(global_batch=32, world_size=2, micro_batch=8), (2, 8)),
        (dict(global_batch=32, world_size=1, micro_batch=8), (4, 8)),
        (dict(global_batch=32, world_size=4, micro_batch=8), (1, 8)),
        (dict(global_batch=36, world_size=3, accumulation=2, micro_batch=6), (2, 6)),
        (dict(global_batch=1, world_size=1), (1, 1)),
    ],
)
def test_batch_plan_derive(kwargs, expected):
    plan = BatchPlan.derive(**kwargs)
    assert (plan.accumulation, plan.micro_batch) == expected
    assert plan.micro_batch * plan.world_size * plan.accumulation == plan.global_batch == kwargs["global_batch"]


@pytest.mark.parametrize(
    "kwargs,bad",
    [
        (dict(global_batch=30, world_size=4), "global batch 30"),  # not divisible by world
        (dict(global_batch=36, world_size=3, accumulation=8), "global batch 36"),  # not divisible by world x accumulation
        (dict(global_batch=32, world_size=2, micro_batch=6), "micro batch 6"),  # micro batch does not divide per-rank 16
        (dict(global_batch=33, world_size=2, micro_batch=3), "global batch 33"),  # not divisible by world
        (dict(global_batch=-4, world_size=1), "global batch -4"),
        (dict(global_batch=0, world_size=2), "global batch 0"),
        (dict(global_batch=32, world_size=2, accumulation=2, micro_batch=4), "micro batch 4"),  # contradicts 32/(2x2)=8
        (dict(global_batch=32, world_size=2, accumulation=0), "accumulation 0"),
        (dict(global_batch=32, world_size=2, micro_batch=0), "micro batch 0"),
    ],
)
def test_batch_plan_errors_name_the_bad_number(kwargs, bad):
    with pytest.raises(ValueError) as e:
        BatchPlan.derive(**kwargs)
    assert bad in str(e.value)


def test_dataset_smaller_than_one_global_batch():
    plan = BatchPlan.derive(32, 2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(31, plan)
    GlobalBatchSampler(32, plan)  # exactly one global batch is fine
    with pytest.raises(ValueError, match="rank 2"):
        GlobalBatchSampler(64, plan, rank=2)


# --- evaluation shards ----------------------------------------------------------------------
@pytest.mark.parametrize("n,world", [(10, 3), (2, 4), (11, 2), (11, 3), (7, 1), (0, 3)])
def test_sharded_eval_covers_each_sample_once(n, world):
    shards = [list(ShardedEvalSampler(n, world, r)) for r in range(world)]
    assert [len(ShardedEvalSampler(n, world, r)) for r in range(world)] == [len(s) for s in shards]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(n))
    assert len(flat) == n
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    if n < world:
        assert any(len(s) == 0 for s in shards)


def test_sharded_eval_bad_rank():
    with pytest.raises(ValueError, match="rank 3"):
        ShardedEvalSampler(10, 3, 3)


def test_dataloader_with_workers_plays_epochs_in_order():
    """DataLoader(num_workers>0) calls iter() on its sampler twice; no epoch may be skipped."""
    from torch.utils.data import DataLoader

    plan = BatchPlan.derive(4, 1)
    sampler = GlobalBatchSampler(12, plan, seed=3)
    loader = DataLoader(list(range(12)), batch_sampler=sampler, num_workers=1)
    got = [[b.tolist() for b in loader] for _ in range(2)]
    assert got == [list(sampler.micro_batches(0)), list(sampler.micro_batches(1))]


def test_rows_as_tensors_are_the_micro_batches_and_play_the_same_epochs():
    plan = BatchPlan.derive(8, 2, 2)
    samplers = [GlobalBatchSampler(37, plan, rank=1, seed=5) for _ in range(2)]
    samplers[0].set_position(3), samplers[1].set_position(3)
    for _ in range(2):  # the rest of epoch 0 from step 3, then all of epoch 1
        lists = list(samplers[0])
        rows = list(samplers[1].iter_rows())
        assert [r.dtype for r in rows] == [torch.int64] * len(rows)
        assert [r.tolist() for r in rows] == lists
    assert samplers[0].position == samplers[1].position == 2 * (37 // 8)
