"""The batched data path reads the same batches as per-sample reads + ``default_collate``."""

import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from paratrain.data import BatchPlan, EvalLoader, GlobalBatchLoader
from paratrain.data.datasets import synthetic
from paratrain.data.loaders import TensorBatchView, batch_view

CPU = torch.device("cpu")


class PerSample(Dataset):
    """``dataset`` read one sample at a time: the reference path."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]


class Dicts(Dataset):
    """Dict samples with ``__getitems__`` (torch's protocol); counts per-sample reads."""

    def __init__(self, n):
        self.x = torch.randn(n, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        self.single_reads = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.single_reads += 1
        return {"x": self.x[i], "y": i % 3}

    def __getitems__(self, indices):
        rows = self.x[torch.as_tensor(indices)]
        return [{"x": r, "y": i % 3} for r, i in zip(rows, indices)]


def tensors(n=40):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 4, 4, generator=g), torch.randint(0, 10, (n,), generator=g),
                         torch.rand(n, 2, generator=g, dtype=torch.float64))


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def train_batches(dataset, start, **kwargs):
    """Rank 1's micro-batches of two epochs from global step ``start`` (world 2, accumulation 2)."""
    step = [start]
    loader = GlobalBatchLoader(dataset, BatchPlan.derive(8, 2, accumulation=2), 1, CPU, seed=5,
                               position=lambda: step[0], **kwargs)
    first = list(loader)
    step[0] = loader.steps_per_epoch
    return loader, first + list(loader)


DATASETS = {
    "TensorDataset": tensors,
    "built-in synthetic": lambda: synthetic(40, (1, 4, 4), 3, seed=2),
    "Subset of a Subset": lambda: Subset(Subset(tensors(60), list(range(59, 4, -1))), list(range(39, -1, -1))),
    "__getitems__": lambda: Dicts(40),
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("start", [0, 3])
@pytest.mark.parametrize("name", list(DATASETS))
def test_train_batches_equal_per_sample_reads(name, start, workers):
    dataset = DATASETS[name]()
    loader, got = train_batches(dataset, start, num_workers=workers)
    single_reads = getattr(dataset, "single_reads", 0)
    _, want = train_batches(PerSample(dataset), start, num_workers=workers)
    assert len(got) == len(want) == (5 - start + 5) * 2
    assert_same(got, want)
    batched = isinstance(loader.dataloader.dataset, TensorBatchView)
    assert batched == (name != "__getitems__")  # that one is read by its own __getitems__
    if workers == 0 and name == "__getitems__":
        assert single_reads == 0


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", list(DATASETS))
def test_eval_batches_equal_per_sample_reads(name, workers):
    dataset = DATASETS[name]()
    loader = EvalLoader(dataset, 7, 3, 1, CPU, num_workers=workers)
    reference = EvalLoader(PerSample(dataset), 7, 3, 1, CPU, num_workers=workers)
    assert len(loader) == len(reference) == 2  # 13 or 14 samples of the shard, in batches of 7
    assert_same(list(loader), list(reference))
    assert_same(loader.first_sample(), reference.first_sample())
    assert isinstance(loader.dataloader.dataset, TensorBatchView) == (name != "__getitems__")


def test_transform_applies_to_batched_reads():
    dataset = tensors()
    plus_one = lambda x, seed, offset, total: x + 1  # noqa: E731
    _, got = train_batches(dataset, 0, transform=plus_one)
    _, want = train_batches(PerSample(dataset), 0, transform=plus_one)
    assert_same(got, want)


class Doubled(TensorDataset):
    def __getitem__(self, i):
        return tuple(2 * t[i] for t in self.tensors)


def test_per_sample_reads_where_a_batch_could_differ():
    data = tensors()
    assert batch_view(data) is not None and batch_view(data, torch.utils.data.default_collate) is not None
    assert batch_view(data, collate_fn=lambda samples: samples) is None  # the user's collate sees samples
    assert batch_view(Doubled(*data.tensors)) is None  # its own __getitem__
    assert batch_view(PerSample(data)) is None
    loader, got = train_batches(Doubled(*data.tensors), 0)
    assert loader.dataloader.dataset.dataset.__class__ is Doubled  # read per sample (SeededSamples)
    _, plain = train_batches(data, 0)
    assert_same(got, [[2 * t for t in b] for b in plain])


def test_view_maps_subset_indices():
    data = tensors(10)
    view = batch_view(Subset(Subset(data, [9, 8, 7, 6, 5]), [4, 0]))
    assert view is not None and len(view) == 2
    x, y, z = view[[0, 1, 1]]
    assert torch.equal(x, data.tensors[0][[5, 9, 9]]) and torch.equal(y, data.tensors[1][[5, 9, 9]])


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.tensor([1.0, 2.0]), 3), (torch.tensor([4.0, 5.0]), 6)])


def test_first_sample_is_a_batch_of_one():
    """What an empty shard forwards to keep a collective forward in step (Parallel.evaluate)."""
    x, y = EvalLoader(Stream(), 2, 2, 1, CPU).first_sample()
    assert torch.equal(x, torch.tensor([[1.0, 2.0]])) and torch.equal(y, torch.tensor([3]))
    data = tensors(2)
    loader = EvalLoader(data, 4, 3, 0, CPU)  # rank 0 of 3 gets no sample of 2
    assert list(loader) == []
    assert_same(loader.first_sample(), [t[:1] for t in data.tensors])


def test_a_view_read_in_this_process_skips_the_dataloader_but_not_its_batches(monkeypatch):
    """0 workers, no pinning: the view is indexed directly with tensor rows
    (``paratrain.data.loaders._read``), and the batches are those the DataLoader reads."""
    from paratrain.data import loaders

    loader = GlobalBatchLoader(tensors(60), BatchPlan.derive(8, 2, accumulation=2), 1, CPU, seed=5,
                               position=lambda: 3)
    loader.sampler.set_position(3)
    want = list(loader.dataloader)  # the DataLoader's own reads of the same epoch

    def not_iterated(self):
        raise AssertionError("the DataLoader was iterated")

    monkeypatch.setattr(loaders.DataLoader, "__iter__", not_iterated)
    got = list(loader)
    assert len(got) == len(want) == (60 // 8 - 3) * 2
    assert_same(got, want)


class RandomlyAugmented(Dataset):
    """Per-sample random "augmentation" on all three global generators, as torchvision's
    transforms (torch), albumentations (random, numpy) draw: sample i is (i, three draws)."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        import random

        import numpy as np

        # Python's and NumPy's generators only for some samples, as a rare transform (p=0.05) draws
        return torch.tensor([float(i), torch.rand(()).item(), random.random() if i % 7 == 3 else -1.0,
                             float(np.random.rand()) if i % 11 == 5 else -1.0], dtype=torch.float64)


def augmented_samples(world, start=0, workers=0, epochs=2):
    """{(epoch, index): the augmented sample} as every rank of a world of ``world`` reads it, from
    global step ``start`` on, for ``epochs`` epochs."""
    seen = {}
    for rank in range(world):
        step = [start]
        loader = GlobalBatchLoader(RandomlyAugmented(), BatchPlan.derive(8, world), rank, CPU, seed=3,
                                   position=lambda step=step: step[0], num_workers=workers,
                                   persistent_workers=False)
        for epoch in range(start // loader.steps_per_epoch, epochs):
            for batch in loader:
                for row in batch:
                    seen[(epoch, int(row[0]))] = row[1:].tolist()
            step[0] = (epoch + 1) * loader.steps_per_epoch
    return seen


def test_random_per_sample_augmentation_does_not_depend_on_world_size_workers_or_resume():
    """Each sample's random draws are seeded by (seed, epoch, index): the same augmented samples at
    world sizes 1 and 2, with 0 or 2 DataLoader workers, and after a resume mid-epoch; a new epoch
    draws anew; and reading does not move the training process's own generators (dropout)."""
    import random

    import numpy as np

    from paratrain.data.loaders import sample_seed

    one = augmented_samples(1)
    assert len(one) == 2 * 48
    for (epoch, i), got in one.items():  # each generator seeded by (seed, epoch, index) before the read
        s = sample_seed(3, epoch, i)
        expected = [torch.rand((), generator=torch.Generator().manual_seed(s)).item(),
                    random.Random(s).random() if i % 7 == 3 else -1.0,
                    float(np.random.RandomState(s & 0xFFFFFFFF).rand()) if i % 11 == 5 else -1.0]
        assert got == expected, (epoch, i)
    assert augmented_samples(2) == one
    assert augmented_samples(2, workers=2) == one
    resumed = augmented_samples(1, start=3)  # step 3 of 6 in epoch 0
    assert resumed and all(one[k] == v for k, v in resumed.items())
    assert one[(0, 5)] != one[(1, 5)]  # another epoch, other draws
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    augmented_samples(1, epochs=1)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("world, accumulation", [(2, 1), (1, 2), (2, 2), (1, 4), (4, 2)])
def test_augmented_samples_do_not_depend_on_world_size_or_accumulation(world, accumulation):
    """Sample j of global step s is augmented alike at every (W, A): the draws once came per
    micro-step, so accumulation (set by micro_batch, hence by the world size) changed them."""
    from paratrain.data.augment import BatchAugment

    images = torch.arange(32 * 3 * 8 * 8, dtype=torch.float32).reshape(32, 3, 8, 8)
    data = TensorDataset(images, torch.arange(32))
    augment = BatchAugment(crop_padding=2, flip=True)

    def samples(w, a):
        out = {}
        for rank in range(w):
            loader = GlobalBatchLoader(data, BatchPlan.derive(16, w, accumulation=a), rank, CPU, seed=3,
                                       transform=augment)
            for x, index in loader:
                out.update({int(i): xi for i, xi in zip(index, x)})
        return out

    ref, got = samples(1, 1), samples(world, accumulation)
    assert ref.keys() == got.keys() and len(ref) == 32
    for i in ref:
        assert torch.equal(got[i], ref[i]), i
