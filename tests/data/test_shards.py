"""Sharded streams (:mod:`paratrain.data.shards`): the global order keeps every sample of shards of any
length at every world size and accumulation; a resumed run opens each shard at its position (by
seeking where the stream can: nothing before the position is read), at another world size too; the
lengths are counted once and cached beside the files; a checkpoint of another stream is refused."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from torch import nn

import paratrain
from paratrain.data import ShardedStream
from paratrain.data.shards import ShardOrder, ShardReader

LENGTHS = (1, 7, 100, 0, 20, 3, 9)
READS: Counter = Counter()  # samples read per shard by this process (counted at the source)


def read(k):
    for j in range(LENGTHS[k]):
        READS[k] += 1
        yield {"id": 1000 * k + j, "x": torch.tensor([float(j % 5)])}


def seek(k, offset):
    for j in range(offset, LENGTHS[k]):
        READS[k] += 1
        yield {"id": 1000 * k + j, "x": torch.tensor([float(j % 5)])}


def order_ids(order, step, world, accumulation):
    """The ids of one step, per rank, from the arithmetic alone."""
    stream = ShardedStream(range(len(LENGTHS)), read, lengths=LENGTHS)
    out = []
    for r in range(world):
        reader = ShardReader(stream)
        out.append([s["id"] for micro in order.micro_batches(step, r, world, accumulation) for seg in micro
                    for s in reader.take(seg)])
    return out


@pytest.mark.parametrize("readers", [1, 3, 7])
@pytest.mark.parametrize("tail", ["drop", "next"])
def test_every_sample_once_per_pass_and_the_same_steps_at_any_world_size(readers, tail):
    total = sum(LENGTHS)  # 140: 35 global batches, no tail; B = 6 below leaves a tail of 2
    for B in (4, 6):
        ref = None
        for world, acc in ((1, 1), (2, 1), (1, 2), (2, 2) if B == 4 else (2, 3), (4, 1) if B == 4 else (3, 2)):
            order = ShardOrder(LENGTHS, readers, B, tail)
            steps = [order_ids(order, s, world, acc) for s in range(3 * total // B)]
            assert all(len(ids) == B // world for per_rank in steps for ids in per_rank)
            merged = [sorted(i for ids in per_rank for i in ids) for per_rank in steps]
            if ref is None:  # one process: the order itself (a step's samples by pass, then reader)
                ref, flat = merged, [i for per_rank in steps for i in per_rank[0]]
            assert merged == ref, (world, acc)  # the same samples in every step
        every = sorted(1000 * k + j for k, n in enumerate(LENGTHS) for j in range(n))
        if tail == "drop":  # each pass: every sample but the pass's last total % B
            per = total // B
            for p in range(3):
                got = sorted(flat[p * per * B:(p + 1) * per * B])
                assert len(got) == len(set(got)) == per * B and set(got) <= set(every)
        else:  # the passes are one order: pass p is exactly positions [p*total, (p+1)*total)
            for p in range(len(flat) // total):
                assert sorted(flat[p * total:(p + 1) * total]) == every
        order = ShardOrder(LENGTHS, readers, B, tail)
        for e in range(3):  # a pass's steps: those whose last sample lies in it
            first = order.first_step(e)
            assert order.epoch_of_step(first) == e and (first == 0 or order.epoch_of_step(first - 1) == e - 1)


def train_ids(pt, stream, steps, **loader_kwargs):
    """A tiny model trained on ``stream`` to global step ``steps``: the ids of each step."""
    torch.manual_seed(0)
    model, opt = pt.setup(net := nn.Linear(1, 1).double(), torch.optim.SGD(net.parameters(), lr=0.01))
    return _continue(pt, model, opt, stream, steps, **loader_kwargs)


def stream(**kw):
    return ShardedStream(range(len(LENGTHS)), read, lengths=LENGTHS, readers=3, **kw)


@pytest.mark.parametrize("seeking", [True, False])
def test_a_resumed_stream_opens_each_shard_at_its_position(tmp_path, capsys, seeking):
    """Stopped at step 50 (the second pass, shards shuffled per pass, tail into the next pass) and
    resumed: the same samples as the run that was not stopped. With ``seek`` nothing before the
    position is read; without it only the open shards are read from their starts, never the steps
    before, and the log says so."""
    kw = dict(seek=seek if seeking else None, shuffle=True, seed=5, tail="next")
    pt = paratrain.Parallel(global_batch=4, accumulation=2)
    full, _, _ = train_ids(pt, stream(**kw), 70)
    pt.close()
    pt = paratrain.Parallel(global_batch=4, accumulation=2)
    _, model, opt = train_ids(pt, stream(**kw), 50)
    pt.save_checkpoint(str(tmp_path), model, opt)
    pt.close()
    READS.clear()
    capsys.readouterr()
    pt = paratrain.Parallel(global_batch=4, accumulation=2)
    torch.manual_seed(0)
    model, opt = pt.setup(net := nn.Linear(1, 1).double(), torch.optim.SGD(net.parameters(), lr=0.01))
    pt.load_checkpoint(str(tmp_path), model, opt)
    loader = pt.train_loader(stream(**kw))
    first = next(iter(loader))["id"].tolist()
    assert first == full[50][:2]  # the first micro-batch of step 50
    if seeking:
        assert sum(READS.values()) == 2  # exactly the two samples of the micro-batch
    else:
        assert sum(READS.values()) <= sum(LENGTHS)  # the open shards from their starts at most, not 50 steps (200)
        assert "reads each open shard from its start" in capsys.readouterr().out
    pt.close()
    pt = paratrain.Parallel(global_batch=4, accumulation=2)
    pt.global_step = 0
    torch.manual_seed(0)
    model, opt = pt.setup(net := nn.Linear(1, 1).double(), torch.optim.SGD(net.parameters(), lr=0.01))
    pt.load_checkpoint(str(tmp_path), model, opt)
    resumed, _, _ = _continue(pt, model, opt, stream(**kw), 70)
    assert resumed == full[50:]
    pt.close()


def _continue(pt, model, opt, data, steps, **loader_kwargs):
    loader = pt.train_loader(data, **loader_kwargs)
    ids, current = [], []
    while pt.global_step < steps:
        for batch in loader:
            current += batch["id"].tolist()
            opt.zero_grad()
            pt.backward(model(batch["x"].double()).pow(2).mean())
            opt.step()
            if pt.micro_step == 0:
                ids.append(current)
                current = []
            if pt.global_step >= steps:
                break
    return ids, model, opt


def save_at_two(rank, directory):
    pt = paratrain.Parallel(strategy="ddp", global_batch=4)
    _, model, opt = train_ids(pt, stream(shuffle=True, seed=5), 41, num_workers=1)
    pt.save_checkpoint(directory, model, opt)
    state = pt.full_state_dict(model)
    pt.close()
    return state


def test_a_stream_stopped_on_two_processes_resumes_on_one_with_the_same_samples(tmp_path):
    """Two ranks (each with a DataLoader worker) train to step 41 and save; one process resumes and
    trains to step 60: its steps and weights are those of one process that ran from the start."""
    pt = paratrain.Parallel(global_batch=4)
    full, model, _ = train_ids(pt, stream(shuffle=True, seed=5), 60)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    pt.close()
    paratrain.launch(save_at_two, nprocs=2, args=(str(tmp_path),), timeout=120)
    pt = paratrain.Parallel(global_batch=4)
    torch.manual_seed(0)
    model, opt = pt.setup(net := nn.Linear(1, 1).double(), torch.optim.SGD(net.parameters(), lr=0.01))
    pt.load_checkpoint(str(tmp_path), model, opt)
    resumed, _, _ = _continue(pt, model, opt, stream(shuffle=True, seed=5), 60)
    assert [sorted(s) for s in resumed] == [sorted(s) for s in full[41:]]
    for k, v in model.state_dict().items():  # float64, the same samples per step: rounding only
        torch.testing.assert_close(v, expected[k], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"another stream \(readers 3 now 2"):
        pt.load_checkpoint(str(tmp_path), model, opt)  # this run's loader is the one above: readers 3
        pt.train_loader(ShardedStream(range(len(LENGTHS)), read, lengths=LENGTHS, readers=2, shuffle=True, seed=5))
    pt.close()


def write_shards(directory, lengths):
    paths = []
    for k, n in enumerate(lengths):
        path = os.path.join(directory, f"part-{k}.txt")
        with open(path, "w") as f:
            f.writelines(f"{1000 * k + j}\n" for j in range(n))
        paths.append(path)
    return paths


OPENED: Counter = Counter()


def read_lines(path):
    OPENED[os.path.basename(path)] += 1
    with open(path) as f:
        for line in f:
            yield {"id": int(line), "x": torch.tensor([0.0])}


def test_lengths_are_counted_once_and_kept_beside_the_files(tmp_path, capsys):
    paths = write_shards(tmp_path, (5, 0, 12))
    pt = paratrain.Parallel(global_batch=4)
    OPENED.clear()
    pt.train_loader(ShardedStream(paths, read_lines))
    assert OPENED == Counter({"part-0.txt": 1, "part-1.txt": 1, "part-2.txt": 1})  # the count
    assert (tmp_path / ".paratrain-lengths.json").is_file()
    assert "counted the samples of 3 shards (17 in all)" in capsys.readouterr().out
    OPENED.clear()
    loader = pt.train_loader(ShardedStream(paths, read_lines))
    assert not OPENED and loader.steps_per_epoch == 4  # read from the cache
    with open(paths[1], "w") as f:
        f.write("1000\n1001\n")  # a shard changed: its size and time do not match the cache
    pt.train_loader(ShardedStream(paths, read_lines))
    assert sum(OPENED.values()) == 3  # counted again
    with open(paths[2], "w") as f:
        f.write("2000\n")  # shorter than the lengths given
    with pytest.raises(ValueError, match=r"part-2.txt'\) ended before sample \d+, but its length is 12: the data "
                                         r"changed since the lengths were taken; give the shards' true lengths"):
        list(pt.train_loader(ShardedStream(paths, read_lines, lengths=[5, 2, 12])))
    pt.close()


def test_sharded_stream_errors_are_one_line():
    with pytest.raises(ValueError, match="lengths has 2 entries for 3 sources"):
        ShardedStream([1, 2, 3], read, lengths=[1, 2])
    with pytest.raises(ValueError, match="tail='end'"):
        ShardedStream([1], read, tail="end")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="holds 3 samples, fewer than one global batch of 4"):
        ShardOrder([1, 2], 2, 4)
    with pytest.raises(ValueError, match="hold no sample"):
        ShardOrder([0, 0], 2, 4, tail="next")


def test_parquet_files_are_a_stream_that_seeks(tmp_path):
    """Three Parquet files (rows 10, 0 and 23, row groups of 7): every row once per pass, lengths
    from the footers (nothing counted), and a loader started at step 5 (a resumed run) gives the
    uninterrupted run's batches from step 5 on."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from paratrain.data.parquet import parquet_stream

    paths = []
    for k, n in enumerate((10, 0, 23)):
        table = pa.table({"id": [1000 * k + j for j in range(n)], "x": [[float(j), 1.0] for j in range(n)],
                          "text": [f"row {j}" for j in range(n)]})
        paths.append(tmp_path / f"part-{k}.parquet")
        pq.write_table(table, paths[-1], row_group_size=7)
    pt = paratrain.Parallel(global_batch=4)
    stream = parquet_stream(paths, columns=["id", "x"], readers=2, tail="next")
    full = [b for _, b in zip(range(12), pt.train_loader(stream))]
    assert full[0]["x"].shape == (4, 2) and "text" not in full[0]
    ids = [i for b in full[:33 // 4] for i in b["id"].tolist()]
    assert len(set(ids)) == len(ids) == 32  # the first 8 steps: 32 of the 33 rows, none twice
    pt.global_step = 5
    resumed = [b["id"].tolist() for _, b in zip(range(3), pt.train_loader(parquet_stream(paths, ["id", "x"], readers=2,
                                                                                          tail="next")))]
    assert resumed == [b["id"].tolist() for b in full[5:8]]
    pt.close()
