"""Streaming data (``IterableDataset``): the samples of every optimizer step are the same at world
size 1, 2 and 4; every rank runs the same number of steps whatever the stream's unknown length;
DataLoader workers duplicate nothing; a sharded stream trains every sample of shards of any
length (1, 7, 100, 0, 20) exactly once per pass; a resumed run continues where it stopped, in a
later pass too."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import paratrain
from paratrain.data import ShardedStream

B = 8
FILE_LENGTHS = (20, 17, 25, 30)  # counted by paratrain (and cached beside the files): 92 samples, 11 steps
UNEQUAL = (1, 7, 100, 0, 20)  # the shards: 128 samples, 32 global batches of 4
OPENED: list[str] = []  # files opened by this process


class Counting(IterableDataset):
    """A generator of unknown length: dict samples numbered 0..n-1."""

    def __init__(self, n):
        self.n = n
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        for i in range(self.n):
            yield {"id": i, "x": torch.tensor([float(i)])}


def read_file(path):
    OPENED.append(os.path.basename(path))
    with open(path) as f:
        for line in f:
            yield {"id": int(line), "x": torch.tensor([float(line)])}


def write_files(directory):
    paths = []
    for k, n in enumerate(FILE_LENGTHS):
        path = os.path.join(directory, f"shard-{k}.txt")
        with open(path, "w") as f:
            f.writelines(f"{1000 * k + j}\n" for j in range(n))
        paths.append(path)
    return paths


def round_robin(lengths):
    """The global order of shards with one virtual reader each: one sample of every shard that has
    one left, in shard order, round after round (the ids ``1000 * shard + sample``)."""
    return [1000 * k + t for t in range(max(lengths)) for k, n in enumerate(lengths) if t < n]


def expected_files_step(s):
    return sorted(round_robin(FILE_LENGTHS)[B * s:B * (s + 1)])


def read_unequal(k):
    for j in range(UNEQUAL[k]):
        yield {"id": 1000 * k + j, "x": torch.tensor([float(j)])}


def train(pt, data, steps=None, passes=1, **loader_kwargs):
    """Train a tiny model on ``data``; returns this rank's sample ids per optimizer step."""
    torch.manual_seed(0)
    if steps is None:
        pt.global_step = 0  # a fresh run on the same Parallel
    model, opt = pt.setup(net := nn.Linear(1, 1), torch.optim.SGD(net.parameters(), lr=0.0))
    loader = pt.train_loader(data, **loader_kwargs)
    ids, current = [], []
    for _ in range(passes):
        for batch in loader:
            current += batch["id"].tolist()
            opt.zero_grad()
            pt.backward(model(batch["x"]).mean())
            opt.step()
            if pt.micro_step == 0:
                ids.append(current)
                current = []
            if steps is not None and pt.global_step >= steps:
                return ids, loader
    return ids, loader


def stream_worker(rank, files):
    world = paratrain.world_size()
    pt = paratrain.Parallel(strategy="ddp", global_batch=B, accumulation=1 if world == 4 else 2)
    report = {}
    report["generator"], _ = train(pt, Counting(50), passes=2)  # 6 steps per pass, the tail of 2 dropped
    if world <= 2:  # DataLoader workers: 2 per rank (8 processes at world size 4 would be slow on 2 cores)
        report["workers"], _ = train(pt, DataLoader(Counting(50), batch_size=B // world // pt.accumulation,
                                                    num_workers=2))
    OPENED.clear()
    report["files"], _ = train(pt, ShardedStream(files, read_file))
    report["opened"] = sorted(set(OPENED))
    for workers in (0, 2):  # the unequal shards, 0 and 2 DataLoader workers
        small = paratrain.Parallel(strategy="ddp", global_batch=4)
        stream = ShardedStream(range(len(UNEQUAL)), read_unequal)  # lengths counted (not files: nothing cached)
        report[f"unequal {workers}"], _ = train(small, stream, passes=2, num_workers=workers)
    for strategy in ("ddp", "fsdp"):  # an evaluation stream: each sample once; fsdp agrees on every forward
        ev = paratrain.Parallel(strategy=strategy, global_batch=B)
        model = ev.setup(eval_model())
        report[f"eval {strategy}"] = ev.evaluate(model, ev.eval_loader(Pairs(21), batch_size=2), nn.functional.mse_loss)
    pt.close()
    return report


def eval_model():
    torch.manual_seed(0)
    return nn.Linear(3, 1).double()


def union_per_step(reports, key, batch=B):
    steps = {len(r[key]) for r in reports}
    assert len(steps) == 1, f"ranks ran different numbers of steps: {steps}"
    merged = []
    for s in range(steps.pop()):
        ids = [i for r in reports for i in r[key][s]]
        assert len(ids) == len(set(ids)) == batch, f"step {s}: {sorted(ids)}"  # nothing duplicated, nothing missing
        merged.append(sorted(ids))
    return merged


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_files(tmp_path_factory.mktemp("shards"))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_streams_give_the_same_steps_at_any_world_size(world, files):
    if world == 1:
        reports = [stream_worker(0, files)]
    else:
        reports = paratrain.launch(stream_worker, nprocs=world, args=(files,), timeout=240)
    generator = [list(range(8 * s, 8 * s + 8)) for s in range(6)]
    assert union_per_step(reports, "generator") == generator * 2  # two passes, the same stream
    if world <= 2:
        assert union_per_step(reports, "workers") == generator
    assert union_per_step(reports, "files") == [expected_files_step(s) for s in range(92 // B)]
    if world == 4:  # while all four files last (17 rounds: 4 steps), rank r reads file r alone
        assert all(f"shard-{r}.txt" in got["opened"] for r, got in enumerate(reports))
    order = round_robin(UNEQUAL)
    for workers in (0, 2):  # every sample of every shard once per pass, in the same steps at every world size
        got = union_per_step(reports, f"unequal {workers}", batch=4)
        assert got == [sorted(order[4 * s:4 * s + 4]) for s in range(32)] * 2, workers
    xs, ys = map(torch.stack, zip(*Pairs(21)))
    with torch.no_grad():
        expected = nn.functional.mse_loss(eval_model()(xs), ys).item()
    for strategy in ("ddp", "fsdp"):
        for r in reports:  # float64: the per-rank sums differ from one mean by rounding only
            assert r[f"eval {strategy}"]["count"] == 21
            assert r[f"eval {strategy}"]["loss"] == pytest.approx(expected, rel=1e-12)


def test_stream_resumes_exactly_also_in_a_later_pass(tmp_path):
    """Checkpoints at step 2 (first pass) and step 8 (third pass, 3 steps per pass) resume exactly."""
    data = Counting(3 * B + 5)  # 3 steps per pass
    pt = paratrain.Parallel(global_batch=B, accumulation=2)
    full, _ = train(pt, data, passes=4)
    assert full == [list(range(8 * (s % 3), 8 * (s % 3) + 8)) for s in range(12)]
    pt.close()
    for stop in (2, 8):
        pt = paratrain.Parallel(global_batch=B, accumulation=2)
        model, opt = pt.setup(net := nn.Linear(1, 1), torch.optim.SGD(net.parameters(), lr=0.0))
        pt.global_step = stop
        pt.save_checkpoint(str(tmp_path / str(stop)), model, opt)
        pt.close()
        pt = paratrain.Parallel(global_batch=B, accumulation=2)
        model, opt = pt.setup(net := nn.Linear(1, 1), torch.optim.SGD(net.parameters(), lr=0.0))
        pt.load_checkpoint(str(tmp_path / str(stop)), model, opt)
        resumed, loader = train(pt, data, steps=12, passes=4)
        assert resumed == full[stop:], stop
        assert data.epochs[-1] == 3
        pt.close()


def test_the_epoch_loop_over_a_stream_resumes_from_the_loader_epoch(tmp_path):
    """``for epoch in range(loader.epoch, epochs)`` after a resume in the second pass: the loader
    says pass 1 before it is iterated (it said 0, and the loop trained a pass too many)."""
    data = Counting(3 * B + 5)  # 3 steps per pass

    def run(stop=None, resume=None):
        pt = paratrain.Parallel(global_batch=B, accumulation=2)
        torch.manual_seed(0)
        model, opt = pt.setup(net := nn.Linear(1, 1).double(), torch.optim.SGD(net.parameters(), lr=0.0))
        loader = pt.train_loader(data)
        if resume:
            pt.load_checkpoint(resume, model, opt)
            assert loader.epoch == 1
        steps = []
        for _epoch in range(loader.epoch, 2):
            for batch in loader:
                opt.zero_grad()
                pt.backward(model(batch["x"].double()).sum())
                opt.step()
                if pt.micro_step == 0:
                    steps.append(pt.global_step)
                if stop and pt.global_step == stop and pt.micro_step == 0:
                    pt.save_checkpoint(str(tmp_path), model, opt)
                    pt.close()
                    return steps
        pt.close()
        return steps

    assert run() == list(range(1, 7))
    run(stop=4)
    assert run(resume=str(tmp_path)) == [5, 6]


def test_stream_errors_are_one_line():
    pt = paratrain.Parallel(global_batch=B)
    with pytest.raises(ValueError, match="no complete global batch"):
        train(pt, Counting(B - 1))
    with pytest.raises(ValueError, match="read in order"):
        pt.train_loader(Counting(50), shuffle=True)
    with pytest.raises(TypeError, match="no length"):
        len(pt.train_loader(Counting(50)))
    pt.close()


def test_huggingface_datasets_map_style_and_iterable():
    """``datasets.Dataset`` (map-style) and ``datasets.IterableDataset`` built in memory. The
    iterable one splits itself between DataLoader workers; paratrain hides the workers from it
    (it splits the micro-batches itself), so with 2 workers no sample is lost or repeated."""
    datasets = pytest.importorskip("datasets")
    table = {"id": list(range(40)), "x": [[float(i)] for i in range(40)]}
    pt = paratrain.Parallel(global_batch=B, seed=3)
    ids, _ = train(pt, datasets.Dataset.from_dict(table).with_format("torch"))
    perm = paratrain.data.epoch_permutation(40, 3, 0)
    assert ids == [perm[B * s:B * (s + 1)].tolist() for s in range(5)]
    stream = datasets.Dataset.from_dict(table).to_iterable_dataset(num_shards=4).with_format("torch")
    for workers in (0, 2):
        ids, _ = train(pt, DataLoader(stream, batch_size=B, num_workers=workers))
        assert ids == [list(range(B * s, B * (s + 1))) for s in range(5)], workers
    pt.close()


class Pairs(IterableDataset):
    """A generator of (x, y) regression pairs, float64: n of them, in order."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(7)
        for _ in range(self.n):
            x = torch.randn(3, generator=g, dtype=torch.float64)
            yield x, x.sum(0, keepdim=True) * 0.5


def test_fit_trains_a_stream_for_max_steps_over_several_passes():
    """``fit`` on a stream: max_steps optimizer steps, re-reading the stream (20 samples: 2 steps
    per pass, the tail of 4 dropped), equal to a plain loop over the same batches; evaluated at the end."""
    from paratrain.loop import fit, planned_steps

    def model_and_opt():
        torch.manual_seed(0)
        model = nn.Linear(3, 1).double()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)

    pt = paratrain.Parallel(global_batch=B, accumulation=2)
    assert planned_steps(pt, Pairs(20), max_steps=5) == 5
    with pytest.raises(ValueError, match="give fit max_steps"):
        planned_steps(pt, Pairs(20))
    model, opt = pt.setup(*model_and_opt())
    result = fit(pt, model, opt, Pairs(20), max_steps=5, loss_fn=nn.functional.mse_loss, eval_set=Pairs(8),
                 progress_bar=False)
    assert result.steps == pt.global_step == 5 and "loss" in result.eval
    got = pt.full_state_dict(model)
    pt.close()

    ref, ref_opt = model_and_opt()
    samples = list(Pairs(20))[:16]  # one pass: two global batches
    for step in range(5):
        xs, ys = map(torch.stack, zip(*samples[(step % 2) * B:(step % 2 + 1) * B]))
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(xs), ys).backward()
        ref_opt.step()
    for k, v in ref.state_dict().items():  # float64, the same batches: rounding only (1e-12)
        torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-12)


class SplitsByWorker(IterableDataset):
    """Splits itself between DataLoader workers, as torch's docs and HuggingFace's streams do."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, self.n, workers):
            yield torch.tensor([float(i)])


def test_an_evaluation_stream_that_splits_by_worker_is_counted_once():
    """It was split twice with 2 workers (by paratrain's share, then by itself): half the samples."""
    pt = paratrain.Parallel(global_batch=4)
    loader = pt.eval_loader(SplitsByWorker(20), batch_size=3, num_workers=2, persistent_workers=True)
    for _ in range(2):  # persistent workers keep their share on the second pass
        assert sorted(int(v) for batch in loader for v in batch.flatten()) == list(range(20))
    pt.close()


def test_a_pass_over_a_stream_draws_nothing_from_the_global_generator():
    """Each DataLoader iterator draws a seed; from torch's global generator it shifted dropout by
    one draw in a resumed run, which started the pass again."""
    pt = paratrain.Parallel(global_batch=B)
    loader = pt.train_loader(Counting(2 * B))
    state = torch.get_rng_state()
    batches = list(loader)
    assert batches and torch.equal(torch.get_rng_state(), state)
    pt.close()


def test_a_streamed_hf_dataset_resumed_mid_epoch_gives_the_uninterrupted_samples(tmp_path):
    """HuggingFace's streamed ``IterableDataset`` (4 shards; it splits itself between DataLoader
    workers, which paratrain hides from it), checkpointed at step 3 of 5 and resumed with 2 workers:
    the same samples in every step as the run that was not stopped, in 3 passes (HuggingFace reads its
    shards in another order in each pass after the first: 0 1 2 3, 0 1 2 3, then 3 2 0 1)."""
    datasets = pytest.importorskip("datasets")
    table = {"id": list(range(43)), "x": [[float(i)] for i in range(43)]}
    stream = datasets.Dataset.from_dict(table).to_iterable_dataset(num_shards=4).with_format("torch")
    pt = paratrain.Parallel(global_batch=B, accumulation=2)
    full, _ = train(pt, stream, passes=3)
    pt.close()
    assert len(full) == 15 and sorted(i for s in full[:5] for i in s) == list(range(40))
    assert full[10][:4] == [33, 34, 35, 36]  # pass 3 opens at shard 3
    pt = paratrain.Parallel(global_batch=B, accumulation=2)
    model, opt = pt.setup(net := nn.Linear(1, 1), torch.optim.SGD(net.parameters(), lr=0.0))
    pt.global_step = 3
    pt.save_checkpoint(str(tmp_path), model, opt)
    pt.close()
    pt = paratrain.Parallel(global_batch=B, accumulation=2)
    model, opt = pt.setup(net := nn.Linear(1, 1), torch.optim.SGD(net.parameters(), lr=0.0))
    pt.load_checkpoint(str(tmp_path), model, opt)
    resumed, _ = train(pt, stream, steps=15, passes=3, num_workers=2)
    assert resumed == full[3:]
    pt.close()


class EpochInItsProcess(Counting):
    """A stream whose ``set_epoch`` refuses to run outside the process that made it, and whose samples
    follow the pass (``100 * epoch + i``)."""

    def __init__(self, n):
        super().__init__(n)
        self.pid = os.getpid()

    def set_epoch(self, epoch):
        assert os.getpid() == self.pid, "set_epoch called in a DataLoader worker"
        super().set_epoch(epoch)

    def __iter__(self):
        for i in range(self.n):
            yield {"id": 100 * self.epochs[-1] + i, "x": torch.tensor([float(i)])}


def test_a_stream_is_told_its_pass_before_its_workers_start_never_by_them():
    """Each DataLoader worker called ``set_epoch``; HuggingFace's epoch is a counter in shared memory
    that it moves by a difference, so two workers moving it at once made the second pass the third,
    now and then, and one worker read its shards in that pass's order."""
    pt = paratrain.Parallel(global_batch=B, accumulation=2)
    stream = EpochInItsProcess(2 * B)
    ids, _ = train(pt, stream, passes=2, num_workers=2)
    pt.close()
    assert stream.epochs == [0, 1]
    assert ids == [list(range(B)), list(range(B, 2 * B)), list(range(100, 100 + B)), list(range(100 + B, 100 + 2 * B))]


OPENED_SHARDS: list[int] = []  # the HF generator's shards opened by this process


def hf_shards(shards):
    for k in shards:
        OPENED_SHARDS.append(k)
        for j in range(11):
            yield {"id": 11 * k + j, "x": [float(j)]}


def hf_generator_stream():
    """HuggingFace's streamed ``IterableDataset`` from a generator: 4 shards of 11 samples, read in order (44
    samples: 5 global batches of 8 a pass, the last 4 samples dropped)."""
    datasets = pytest.importorskip("datasets")
    return datasets.IterableDataset.from_generator(hf_shards, gen_kwargs={"shards": list(range(4))}).with_format("torch")


def resume_hf(rank, path, workers=0):
    """This rank's sample ids per step of a run resumed from ``path``, and the shards it opened."""
    pt = paratrain.Parallel(strategy="ddp", global_batch=B)
    model, opt = pt.setup(net := nn.Linear(1, 1), torch.optim.SGD(net.parameters(), lr=0.0))
    pt.load_checkpoint(path, model, opt)
    OPENED_SHARDS.clear()
    ids, _ = train(pt, hf_generator_stream(), steps=10, passes=2, num_workers=workers)
    pt.close()
    return ids, list(OPENED_SHARDS)


def test_a_stream_with_its_own_state_dict_resumes_there_without_reading_at_any_world_size(tmp_path, capsys):
    """A run stopped at step 3 of a pass keeps HuggingFace's own ``state_dict()`` of the stream in its checkpoint.
    Resumed with 0 or 2 DataLoader workers, or at world size 2, it trains the samples of the run that was not
    stopped, and opens only the shard the position lies in (2) and those after it: nothing before is read again.
    A run saved between two passes starts the next one without reading anything either."""
    pt = paratrain.Parallel(global_batch=B)
    full, _ = train(pt, hf_generator_stream(), passes=2)
    pt.close()
    assert len(full) == 10 and sorted(i for s in full[:5] for i in s) == list(range(40))
    for stop in (3, 5):
        pt = paratrain.Parallel(global_batch=B)
        part, _ = train(pt, hf_generator_stream(), steps=stop, passes=2)
        assert part == full[:stop]
        model, opt = pt.setup(net := nn.Linear(1, 1), torch.optim.SGD(net.parameters(), lr=0.0))
        pt.save_checkpoint(str(tmp_path / str(stop)), model, opt)
        pt.close()
    capsys.readouterr()
    for workers in (0, 2):
        ids, opened = resume_hf(0, str(tmp_path / "3"), workers)
        assert ids == full[3:], workers
        if workers == 0:
            assert opened[0] == 2 and "opens the stream at its own state_dict() (step 3 of pass 0)" in capsys.readouterr().out
    ids, opened = resume_hf(0, str(tmp_path / "5"))
    assert ids == full[5:] and "reads the stream" not in capsys.readouterr().out
    pt = paratrain.Parallel(global_batch=B)  # a loop that breaks off at step 4, then iterates the same loader on
    model, opt = pt.setup(net := nn.Linear(1, 1), torch.optim.SGD(net.parameters(), lr=0.0))
    pt.load_checkpoint(str(tmp_path / "3"), model, opt)
    loader, got = pt.train_loader(hf_generator_stream()), []
    for stop in (4, None):
        for batch in loader:
            got.append(batch["id"].tolist())
            pt.backward(model(batch["x"]).mean())
            opt.step()
            if pt.global_step == stop:
                break
    assert got == full[3:5]
    pt.close()
    reports = paratrain.launch(resume_hf, nprocs=2, args=(str(tmp_path / "3"),), timeout=120)
    assert union_per_step([{"ids": ids} for ids, _ in reports], "ids") == [sorted(s) for s in full[3:]]
    assert all(opened[0] == 2 for _, opened in reports)


def test_which_streams_are_opened_at_their_own_state():
    """HF's stream can; shuffled with a buffer it cannot (the buffer's samples are not in its state), nor can a
    plain generator: both are read up to the step, and the run says why."""
    from paratrain.data.stream import own_position

    stream = hf_generator_stream()
    assert own_position(stream) is None
    assert "shuffle buffer" in own_position(stream.shuffle(seed=0, buffer_size=4))
    assert "state_dict()" in own_position(Counting(3))


def test_a_stream_split_by_node_already_is_one_line():
    """HuggingFace's split_dataset_by_node hands each rank its part; paratrain would then keep each rank's share of
    that part, and lose the rest. A split for one process (world size 1) changes nothing and is taken."""
    stream = hf_generator_stream()  # skipped without datasets
    from datasets.distributed import split_dataset_by_node

    pt = paratrain.Parallel(global_batch=B)
    message = (r"train_loader: the stream was split by split_dataset_by_node \(rank 1 of 2\); paratrain shares a stream "
               r"out between the ranks itself .*: pass the dataset before split_dataset_by_node")
    with pytest.raises(ValueError, match=message):
        pt.train_loader(split_dataset_by_node(stream, rank=1, world_size=2))
    with pytest.raises(ValueError, match=message.replace("train_loader", "eval_loader")):
        pt.eval_loader(DataLoader(split_dataset_by_node(stream, rank=1, world_size=2), batch_size=4))
    ids, _ = train(pt, split_dataset_by_node(stream, rank=0, world_size=1))
    assert len(ids) == 5
    pt.close()
