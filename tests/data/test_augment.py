import pytest
import torch

from paratrain.data.augment import BatchAugment, augment_for, eval_augment_for
from paratrain.data.datasets import CIFAR10_MEAN, CIFAR10_STD


def _batch(n=8, c=3, h=6, w=5):
    return torch.arange(n * c * h * w, dtype=torch.float32).reshape(n, c, h, w) + 1.0


def test_split_batch_gets_the_same_augmentation_as_whole():
    aug = BatchAugment(crop_padding=2, flip=True, mean=(0.5, 0.2, 0.1), std=(2.0, 3.0, 4.0))
    x = _batch()
    for seed in range(5):
        whole = aug(x, seed)
        parts = torch.cat([aug(x[:3], seed, offset=0, total=8), aug(x[3:], seed, offset=3, total=8)])
        assert torch.equal(whole, parts)
    assert not torch.equal(aug(x, 0), aug(x, 1))


def test_no_crop_no_flip_is_identity_plus_normalisation():
    x = _batch()
    assert torch.equal(BatchAugment(crop_padding=0, flip=False)(x, seed=3), x)
    mean, std = (1.0, 2.0, 3.0), (0.5, 0.25, 2.0)
    out = BatchAugment(crop_padding=0, flip=False, mean=mean, std=std)(x, seed=3)
    expected = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert torch.allclose(out, expected)


def test_flip_flips_exactly_the_drawn_samples():
    x = _batch(n=64)
    aug = BatchAugment(crop_padding=0, flip=True)
    out = aug(x, seed=7)
    _, _, flips = aug.draws(7, 64)
    assert 0 < int(flips.sum()) < 64
    assert torch.equal(out[flips], x[flips].flip(-1))
    assert torch.equal(out[~flips], x[~flips])


def test_crop_is_a_shifted_window_of_the_zero_padded_image():
    x = _batch(n=16, c=2, h=7, w=9)
    aug = BatchAugment(crop_padding=3, flip=False)
    out = aug(x, seed=1)
    assert out.shape == x.shape
    dy, dx, _ = aug.draws(1, 16)
    padded = torch.nn.functional.pad(x, (3, 3, 3, 3))
    for i in range(16):
        window = padded[i, :, dy[i] : dy[i] + 7, dx[i] : dx[i] + 9]
        assert torch.equal(out[i], window)
    assert (dy != 3).any()  # some sample actually moved


def test_crop_and_flip_together_are_the_per_sample_window_then_flip():
    x = _batch(n=32, c=3, h=5, w=8)  # not square: rows and columns of the padded image differ
    aug = BatchAugment(crop_padding=2, flip=True)
    out = aug(x, seed=4)
    dy, dx, flips = aug.draws(4, 32)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(32):
        window = padded[i, :, dy[i] : dy[i] + 5, dx[i] : dx[i] + 8]
        assert torch.equal(out[i], window.flip(-1) if flips[i] else window)
    assert 0 < int(flips.sum()) < 32


@pytest.mark.parametrize("shape", [(5, 1, 8, 8), (4, 3, 32, 32), (2, 4, 3, 11)])
def test_shape_and_dtype_preserved(shape):
    x = torch.randn(shape, dtype=torch.float64)
    out = BatchAugment()(x, seed=0)
    assert out.shape == x.shape and out.dtype == x.dtype


def test_bad_arguments():
    x = _batch()
    with pytest.raises(ValueError, match="total=8"):
        BatchAugment()(x[:4], seed=0, offset=6, total=8)
    with pytest.raises(ValueError, match="channels"):
        BatchAugment(mean=(0.5,), std=(0.5,))(x, seed=0)
    with pytest.raises(ValueError, match="crop_padding"):
        BatchAugment(crop_padding=-1)


def test_augment_for():
    cifar = augment_for("cifar10")
    assert cifar is not None and cifar.crop_padding == 4 and cifar.flip
    assert cifar.mean == CIFAR10_MEAN and cifar.std == CIFAR10_STD
    syn = augment_for("synthetic")
    assert syn is not None and syn.mean is None and syn.flip
    assert augment_for("digits") is None
    ev = eval_augment_for("cifar10")
    assert ev is not None and ev.crop_padding == 0 and not ev.flip and ev.mean == CIFAR10_MEAN
    assert eval_augment_for("digits") is None
