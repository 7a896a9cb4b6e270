import os
import pickle

import numpy as np
import pytest
import torch

from paratrain.data.datasets import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    build_dataset,
    cifar10,
    dataset_info,
    digits,
    synthetic,
)


# ----------------------------------------------------------------------------- digits


def test_digits_split_shapes_and_deterministic():
    train, test = digits(train=True), digits(train=False)
    xtr, ytr = train.tensors
    xte, yte = test.tensors
    assert len(train) + len(test) == 1797
    assert len(test) == round(1797 * 0.2)
    assert xtr.shape[1:] == (1, 8, 8) and xtr.dtype == torch.float32
    assert ytr.dtype == torch.int64 and set(ytr.tolist()) == set(range(10))
    again = digits(train=True)
    assert torch.equal(again.tensors[0], xtr) and torch.equal(again.tensors[1], ytr)
    other = digits(train=True, split_seed=1)
    assert not torch.equal(other.tensors[1], ytr)


def test_digits_split_is_a_partition_of_the_raw_data():
    from sklearn.datasets import load_digits

    raw_x, raw_y = load_digits(return_X_y=True)
    (xtr, ytr), (xte, yte) = digits(train=True).tensors, digits(train=False).tensors
    both = torch.cat([xtr, xte]).flatten(1)
    # Normalisation is one increasing affine map, so the 17 distinct levels map back to 0..16.
    levels, codes = torch.unique(both, return_inverse=True)
    assert len(levels) == 17
    rows = sorted(zip(codes.tolist(), torch.cat([ytr, yte]).tolist()))
    expected = sorted(zip(raw_x.astype(int).tolist(), raw_y.tolist()))
    assert rows == expected


def test_digits_train_is_normalised():
    x = digits(train=True).tensors[0]
    # normalised with its own float32 mean and std: 0 and 1 up to float32 rounding of sums over
    # 92k values (measured 9e-8 and 0), far inside these bounds
    assert abs(x.mean().item()) < 1e-4
    assert abs(x.std().item() - 1.0) < 1e-3
    xte = digits(train=False).tensors[0]
    assert abs(xte.mean().item()) < 0.2  # test uses the train statistics


def test_digits_bad_fraction():
    with pytest.raises(ValueError, match="test_fraction"):
        digits(train=True, test_fraction=1.5)


# ----------------------------------------------------------------------------- cifar10


def _write_batch(path, n, seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, 10, size=n)]
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"fake batch", b"labels": labels, b"data": data}, f, protocol=2)
    return data, labels


def _fake_cifar(root):
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    train = [_write_batch(folder / f"data_batch_{i}", 4, i) for i in range(1, 6)]
    test = _write_batch(folder / "test_batch", 6, 99)
    return folder, train, test


def test_cifar10_reads_python_layout(tmp_path):
    folder, train, test = _fake_cifar(tmp_path)
    ds = cifar10(tmp_path, train=True)
    x, y = ds.tensors
    assert x.shape == (20, 3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64
    assert y.tolist() == sum((lab for _, lab in train), [])
    raw = np.concatenate([d for d, _ in train]).reshape(-1, 3, 32, 32)
    assert torch.allclose(x, torch.from_numpy(raw).float() / 255)
    assert 0.0 <= x.min().item() and x.max().item() <= 1.0
    # data_dir may also be the cifar-10-batches-py folder itself
    xt, yt = cifar10(str(folder), train=False).tensors
    assert xt.shape == (6, 3, 32, 32) and yt.tolist() == test[1]
    # row-major CHW: first 1024 bytes are the red plane
    assert torch.allclose(xt[0, 0].flatten(), torch.from_numpy(test[0][0, :1024]).float() / 255)


def test_cifar10_any_protocol(tmp_path):
    folder, _, _ = _fake_cifar(tmp_path)
    data = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": data, b"labels": [3, 7]}, f, protocol=pickle.HIGHEST_PROTOCOL)
    x, y = build_dataset("cifar10", train=False, data_dir=str(tmp_path)).tensors
    assert y.tolist() == [3, 7] and x.shape == (2, 3, 32, 32)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo hi",))


def test_cifar10_refuses_malicious_pickle(tmp_path):
    folder, _, _ = _fake_cifar(tmp_path)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": _Evil(), b"labels": []}, f)
    # refused before anything runs, and said in one line that names the file and the refused global
    with pytest.raises(ValueError, match=r"test_batch is not a readable CIFAR-10 batch: UnpicklingError: refused global '\w+\.system'"):
        cifar10(tmp_path, train=False)


def test_cifar10_missing_dir_and_file(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        cifar10(missing, train=True)
    folder, _, _ = _fake_cifar(tmp_path)
    os.remove(folder / "data_batch_3")
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        cifar10(tmp_path, train=True)
    cifar10(tmp_path, train=False)  # the test split is still there


def test_cifar10_constants():
    assert len(CIFAR10_MEAN) == len(CIFAR10_STD) == 3


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_learnable_and_deterministic():
    ds = synthetic(200, shape=(3, 8, 8), num_classes=4, seed=3)
    x, y = ds.tensors
    assert x.shape == (200, 3, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert y.bincount().tolist() == [50, 50, 50, 50]
    means = torch.stack([x[y == k].mean(0) for k in range(4)])
    dist = torch.cdist(means.flatten(1), means.flatten(1))
    assert dist[~torch.eye(4, dtype=torch.bool)].min() > 5.0
    # nearest class mean classifies most samples
    pred = torch.cdist(x.flatten(1), means.flatten(1)).argmin(1)
    assert (pred == y).float().mean() > 0.95
    again = synthetic(200, shape=(3, 8, 8), num_classes=4, seed=3)
    assert torch.equal(again.tensors[0], x) and torch.equal(again.tensors[1], y)


def test_synthetic_train_test_share_patterns_not_noise():
    xtr, ytr = synthetic(100, shape=(1, 4, 4), num_classes=2, seed=0, train=True).tensors
    xte, yte = synthetic(100, shape=(1, 4, 4), num_classes=2, seed=0, train=False).tensors
    assert not torch.equal(xtr, xte)
    mtr = torch.stack([xtr[ytr == k].mean(0) for k in range(2)])
    mte = torch.stack([xte[yte == k].mean(0) for k in range(2)])
    assert (mtr - mte).abs().mean() < 0.5


# ----------------------------------------------------------------------------- entry points


def test_build_dataset_names_and_errors():
    assert len(build_dataset("synthetic", train=True, synthetic_size=50)) == 50
    assert len(build_dataset("synthetic", train=False, synthetic_size=50)) == 10
    assert len(build_dataset("digits", train=False)) == 359
    with pytest.raises(ValueError, match="digits"):
        build_dataset("imagenet", train=True)
    with pytest.raises(ValueError, match="--data-dir"):
        build_dataset("cifar10", train=True)


def test_build_dataset_torchvision_missing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchvision", None)
    with pytest.raises(ValueError, match="torchvision"):
        build_dataset("torchvision:CIFAR10", train=True, data_dir="/tmp")


def test_dataset_info():
    assert dataset_info("digits") == {"input_shape": (1, 8, 8), "num_classes": 10}
    assert dataset_info("cifar10") == {"input_shape": (3, 32, 32), "num_classes": 10}
    assert dataset_info("synthetic")["input_shape"] == (3, 32, 32)
    assert dataset_info("synthetic")["input_shape"] == tuple(
        build_dataset("synthetic", train=True, synthetic_size=10).tensors[0].shape[1:]
    )
    with pytest.raises(ValueError, match="bogus"):
        dataset_info("bogus")


def test_cifar10_reads_numpy1_style_globals(tmp_path):
    # The real CIFAR-10 files were written by numpy < 2, which names numpy.core.multiarray.
    folder, _, _ = _fake_cifar(tmp_path)
    data = np.full((1, 3072), 255, dtype=np.uint8)
    blob = pickle.dumps({b"data": data, b"labels": [9]}, protocol=2)
    old = b"cnumpy._core.multiarray\n_reconstruct\n"
    assert old in blob
    blob = blob.replace(old, b"cnumpy.core.multiarray\n_reconstruct\n")
    (folder / "test_batch").write_bytes(blob)
    x, y = cifar10(tmp_path, train=False).tensors
    assert y.tolist() == [9] and torch.equal(x, torch.ones(1, 3, 32, 32))


def test_dataset_size_is_the_built_sets_length_without_building_it(monkeypatch):
    """Issue 25: ``paratrain train`` counts the training set before it starts workers; digits and the
    synthetic set say their length without being built (the others are built and counted)."""
    from paratrain.data import datasets

    sizes = {(name, train, n): datasets.dataset_size(name, train, None, n)
             for name, n in (("digits", None), ("synthetic", None), ("synthetic", 100), ("synthetic", 3))
             for train in (True, False)}
    for (name, train, n), size in sizes.items():
        assert size == len(build_dataset(name, train=train, synthetic_size=n)), (name, train, n)
    assert datasets.dataset_size("cifar10", True, "/nowhere") is None  # its files say it once read
    monkeypatch.setattr(datasets, "digits", lambda *a, **k: pytest.fail("digits built to be counted"))
    assert datasets.dataset_size("digits") == 1438
