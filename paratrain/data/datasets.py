"""Datasets paratrain trains on: real ones that need no download, CIFAR-10 from disk, synthetic data.

Every builder returns a ``torch.utils.data.TensorDataset`` of ``(float32 images (N, C, H, W),
int64 labels)`` so that whole batches can be sliced, moved to a device and augmented there
(see :mod:`paratrain.data.augment`). Nothing here downloads anything.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from ..env.seeding import mix_seed
from ..userfn import is_user_spec, load_callable

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "DATASET_NAMES",
    "build_dataset",
    "dataset_size",
    "cifar10",
    "dataset_info",
    "digits",
    "synthetic",
]

#: Per-channel mean and standard deviation of the CIFAR-10 training images, scaled to [0, 1].
CIFAR10_MEAN: tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
CIFAR10_STD: tuple[float, float, float] = (0.2470, 0.2435, 0.2616)

#: The built-in dataset names :func:`build_dataset` accepts (plus ``"torchvision:<ClassName>"``).
DATASET_NAMES: tuple[str, ...] = ("digits", "cifar10", "synthetic")

_INFO: dict[str, dict[str, Any]] = {
    "digits": {"input_shape": (1, 8, 8), "num_classes": 10},
    "cifar10": {"input_shape": (3, 32, 32), "num_classes": 10},
    "synthetic": {"input_shape": (3, 32, 32), "num_classes": 10},
}

# Shapes of the common torchvision datasets (after ToTensor), for dataset_info("torchvision:...").
_TORCHVISION_INFO: dict[str, dict[str, Any]] = {
    "CIFAR10": {"input_shape": (3, 32, 32), "num_classes": 10},
    "CIFAR100": {"input_shape": (3, 32, 32), "num_classes": 100},
    "MNIST": {"input_shape": (1, 28, 28), "num_classes": 10},
    "FashionMNIST": {"input_shape": (1, 28, 28), "num_classes": 10},
    "KMNIST": {"input_shape": (1, 28, 28), "num_classes": 10},
}

_DEFAULT_SYNTHETIC_SIZE = 4096

_CIFAR_DIRNAME = "cifar-10-batches-py"
_CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST_FILES = ("test_batch",)
_CIFAR_LAYOUT = (
    f"expected {_CIFAR_DIRNAME}/data_batch_1..5 and test_batch "
    "(the 'CIFAR-10 python version' archive, extracted)"
)


# --------------------------------------------------------------------------- digits

_DIGITS_FILE = os.path.join(os.path.dirname(__file__), "files", "digits.npz")
_DIGITS_TEST_FRACTION = 0.2


def _digits_test_size(n: int, test_fraction: float) -> int:
    """Images of the test split of ``n``: ``round(n * test_fraction)``, neither split empty."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r} must be strictly between 0 and 1")
    n_test = int(round(n * test_fraction))
    if not 0 < n_test < n:
        raise ValueError(f"test_fraction={test_fraction!r} leaves an empty split of {n} images")
    return n_test


def digits(train: bool, test_fraction: float = _DIGITS_TEST_FRACTION, split_seed: int = 0) -> TensorDataset:
    """The 8×8 handwritten digits that scikit-learn bundles (1797 real images, 10 classes), shipped
    inside paratrain (``data/files/digits.npz``; see ``DIGITS_NOTICE.txt``): no download, no scikit-learn.

    Images are ``float32`` of shape ``(N, 1, 8, 8)``, scaled to [0, 1] and then normalised with the
    scalar mean and std of the *train* split; labels are ``int64``. The split is a permutation from
    a ``torch.Generator`` seeded with ``split_seed``: the first ``round(1797 * test_fraction)``
    indices are the test split, the rest the train split, so it is the same on every process.
    """
    with np.load(_DIGITS_FILE) as f:
        images, labels = f["images"], f["labels"]
    x = torch.from_numpy(images.astype(np.float32)).reshape(-1, 1, 8, 8) / 16.0
    y = torch.from_numpy(labels.astype(np.int64))
    n = len(y)
    n_test = _digits_test_size(n, test_fraction)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(split_seed)))
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    x_train = x[train_idx]
    mean = x_train.mean()
    std = x_train.std().clamp_min(1e-8)
    idx = train_idx if train else test_idx
    return TensorDataset(((x[idx] - mean) / std).contiguous(), y[idx].clone())


# --------------------------------------------------------------------------- cifar10


def _numpy_global(module: str, name: str) -> Any:
    import importlib

    return getattr(importlib.import_module(module), name)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """The only globals a CIFAR-10 pickle needs: what rebuilds a numpy array (any pickle protocol)."""
    import _codecs

    try:
        reconstruct = _numpy_global("numpy._core.multiarray", "_reconstruct")
        frombuffer = _numpy_global("numpy._core.numeric", "_frombuffer")
    except (ImportError, AttributeError):  # numpy < 2
        reconstruct = _numpy_global("numpy.core.multiarray", "_reconstruct")
        frombuffer = _numpy_global("numpy.core.numeric", "_frombuffer")
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _codecs.encode,
    }
    # Pickles name numpy's internals as numpy.core (numpy < 2, e.g. the real CIFAR-10 files) or
    # numpy._core (numpy >= 2); both resolve to the same functions here, without importing the
    # deprecated numpy.core shim.
    for core in ("numpy.core", "numpy._core"):
        allowed[(f"{core}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{core}.numeric", "_frombuffer")] = frombuffer
    return allowed


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """An unpickler that rebuilds dicts, lists, bytes and numpy arrays and refuses every other global.

    A pickle can name any callable (``os.system`` ...) and have it run on load; this one only
    resolves the handful of numpy globals that recreate an ``ndarray``.
    """

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _ArrayOnlyUnpickler._allowed is None:
            _ArrayOnlyUnpickler._allowed = _allowed_globals()
        try:
            return _ArrayOnlyUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refused global '{module}.{name}' in a CIFAR-10 batch file: "
                "only numpy array data is allowed; is this really CIFAR-10?"
            ) from None


def _load_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 python batch file into ``(uint8 (N, 3, 32, 32), int64 (N,))`` safely."""
    with open(path, "rb") as f:
        try:
            batch = _ArrayOnlyUnpickler(f, encoding="bytes").load()
        except Exception as e:  # garbage, truncated or crafted bytes: say which file, in one line
            raise ValueError(f"{path} is not a readable CIFAR-10 batch: {type(e).__name__}: {e}") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"{path} is not a CIFAR-10 batch: expected a dict with b'data' and b'labels'")
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{path} has data of shape {data.shape} and {labels.shape[0]} labels: "
            "expected N×3072 uint8 rows and N labels"
        )
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_dir(data_dir: str | os.PathLike[str]) -> str:
    root = os.fspath(data_dir)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"CIFAR-10 directory {root!r} does not exist: {_CIFAR_LAYOUT}")
    nested = os.path.join(root, _CIFAR_DIRNAME)
    if os.path.isdir(nested):
        return nested
    return root


def cifar10(data_dir: str | os.PathLike[str], train: bool) -> TensorDataset:
    """CIFAR-10 read from its standard python layout, without executing pickled code.

    ``data_dir`` may contain ``cifar-10-batches-py/`` or be that folder itself. The train split is
    ``data_batch_1`` .. ``data_batch_5`` (all five required), the test split ``test_batch``.
    Returns ``float32`` images ``(N, 3, 32, 32)`` in [0, 1] (normalisation is done by
    :class:`paratrain.data.augment.BatchAugment`) and ``int64`` labels.
    """
    folder = _cifar_dir(data_dir)
    names = _CIFAR_TRAIN_FILES if train else _CIFAR_TEST_FILES
    paths = [os.path.join(folder, name) for name in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"CIFAR-10 file {missing[0]!r} is missing: {_CIFAR_LAYOUT}")
    parts = [_load_cifar_batch(p) for p in paths]
    data = np.concatenate([d for d, _ in parts])
    labels = np.concatenate([y for _, y in parts])
    x = torch.from_numpy(data).to(torch.float32).div_(255.0)
    return TensorDataset(x, torch.from_numpy(labels))


# --------------------------------------------------------------------------- synthetic


def synthetic(
    n: int,
    shape: tuple[int, ...] = (3, 32, 32),
    num_classes: int = 10,
    seed: int = 0,
    train: bool = True,
) -> TensorDataset:
    """Class-conditional random data for throughput benchmarks (not a measure of accuracy).

    Each class has a fixed random mean pattern drawn from a generator seeded with ``seed``; a
    sample is its class pattern plus unit Gaussian noise. Train and test share the patterns but
    draw noise (and label order) from different seeds. Labels are balanced (``i % num_classes``,
    shuffled).
    """
    if n < 1:
        raise ValueError(f"synthetic dataset size n={n} must be >= 1")
    if num_classes < 1:
        raise ValueError(f"num_classes={num_classes} must be >= 1")
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"synthetic shape {shape} must be non-empty with positive sizes")
    patterns = torch.randn((num_classes, *shape), generator=torch.Generator().manual_seed(int(seed)))
    noise_seed = mix_seed(seed, 1 if train else 2, bits=63)
    gen = torch.Generator().manual_seed(noise_seed)
    labels = (torch.arange(n) % num_classes)[torch.randperm(n, generator=gen)]
    x = patterns[labels] + torch.randn((n, *shape), generator=gen)
    return TensorDataset(x.to(torch.float32), labels.to(torch.int64))


# --------------------------------------------------------------------------- entry points


def _torchvision_dataset(class_name: str, train: bool, data_dir: str | None) -> Dataset:
    try:
        import torchvision
        from torchvision import transforms
    except ImportError:
        raise ValueError(
            f"dataset 'torchvision:{class_name}' needs torchvision, which is not installed: "
            f"pip install 'paratrain[data]' (torchvision matching your torch, e.g. torch==2.14.1 "
            f"torchvision==0.29.1) or use one of "
            f"{', '.join(DATASET_NAMES)}"
        ) from None
    cls = getattr(torchvision.datasets, class_name, None)
    if cls is None or not isinstance(cls, type):
        raise ValueError(
            f"torchvision.datasets has no dataset class {class_name!r}: check the name (e.g. CIFAR10)"
        )
    if data_dir is None:
        raise ValueError(f"dataset 'torchvision:{class_name}' needs its root: pass --data-dir")
    try:
        return cls(root=data_dir, train=train, download=False, transform=transforms.ToTensor())
    except TypeError:  # datasets such as SVHN take split= instead of train=
        return cls(
            root=data_dir,
            split="train" if train else "test",
            download=False,
            transform=transforms.ToTensor(),
        )


def token_files(name: str, train: bool) -> Path:
    """The token file of ``tokens:PATH``'s split: a folder holds nanoGPT's ``train.bin`` and
    ``val.bin``; a file is the training split, evaluated on the ``val.bin`` beside it, or on itself
    when there is none."""
    path = Path(name.split(":", 1)[1]).expanduser()
    if path.is_dir():
        split = path / ("train.bin" if train else "val.bin")
        if not split.is_file():
            raise FileNotFoundError(f"dataset {name!r}: the folder has no {split.name} (nanoGPT's layout: train.bin and "
                                    "val.bin): point tokens: at a token file or such a folder")
        return split
    if not path.is_file():
        raise FileNotFoundError(f"dataset {name!r}: {str(path)!r} does not exist: point tokens: at a token file "
                                "(nanoGPT's train.bin) or a folder holding train.bin and val.bin")
    return path if train or not (path.parent / "val.bin").is_file() else path.parent / "val.bin"


def build_dataset(
    name: str,
    train: bool,
    data_dir: str | None = None,
    synthetic_size: int | None = None,
    seed: int = 0,
    block_size: int = 256,
    token_dtype: str = "uint16",
) -> Dataset:
    """Build the train or test split of a dataset by name.

    ``name`` is one of :data:`DATASET_NAMES` or ``"torchvision:<ClassName>"`` (e.g.
    ``"torchvision:CIFAR10"``, read from ``data_dir`` with ``download=False`` and ``ToTensor``), or
    ``"tokens:PATH"`` (a token file, or a folder with nanoGPT's ``train.bin``/``val.bin``: windows
    of ``block_size`` tokens of ``token_dtype``, :class:`~paratrain.data.tokens.TokenWindows`).
    ``synthetic_size`` is the train size of ``"synthetic"`` (default 4096); its test split has a
    fifth of that. ``seed`` seeds the digits split and the synthetic patterns.
    """
    if name.startswith("tokens:"):
        from .tokens import TokenWindows

        return TokenWindows(token_files(name, train), block_size, token_dtype)
    if name.startswith("torchvision:"):
        return _torchvision_dataset(name.split(":", 1)[1], train, data_dir)
    if is_user_spec(name):  # the user's own: fn(train=..., data_dir=...) -> Dataset of (input, label)
        return load_callable(name, "dataset")(train=train, data_dir=data_dir)
    if name == "digits":
        return digits(train=train, split_seed=seed)
    if name == "cifar10":
        if data_dir is None:
            raise ValueError(
                "dataset 'cifar10' needs its files: pass --data-dir pointing at the folder "
                f"that holds {_CIFAR_DIRNAME}/"
            )
        return cifar10(data_dir, train=train)
    if name == "synthetic":
        info = _INFO["synthetic"]
        return synthetic(_synthetic_split(synthetic_size, train), info["input_shape"], info["num_classes"], seed=seed,
                         train=train)
    raise ValueError(
        f"unknown dataset {name!r}: choose one of {', '.join(DATASET_NAMES)} "
        "or 'torchvision:<ClassName>'"
    )


def _synthetic_split(synthetic_size: int | None, train: bool) -> int:
    """Samples of the synthetic set's split: ``synthetic_size`` for train, a fifth of it for test."""
    size = _DEFAULT_SYNTHETIC_SIZE if synthetic_size is None else int(synthetic_size)
    if size < 1:
        raise ValueError(f"synthetic_size={synthetic_size} must be >= 1")
    return size if train else max(1, size // 5)


def dataset_size(name: str, train: bool = True, data_dir: str | None = None,
                 synthetic_size: int | None = None) -> int | None:
    """How many samples :func:`build_dataset` would return, known without building the data set:
    digits (its file's labels) and synthetic; ``None`` for the others, whose files say it only once
    read (build them and count)."""
    if name == "digits":
        with np.load(_DIGITS_FILE) as f:
            n = len(f["labels"])
        n_test = _digits_test_size(n, _DIGITS_TEST_FRACTION)
        return n_test if not train else n - n_test
    if name == "synthetic":
        return _synthetic_split(synthetic_size, train)
    return None


def _input_and_label(sample: Any, name: str) -> tuple[Any, Any]:
    """A sample's input and label: ``(x, y)``, or a dict's first tensor (``input_ids``,
    ``pixel_values``...) and its ``labels``/``label``."""
    if isinstance(sample, Mapping):
        label = sample.get("labels") if sample.get("labels") is not None else sample.get("label")
        inputs = [v for k, v in sample.items()
                  if k not in ("labels", "label") and isinstance(v, (torch.Tensor, np.ndarray, list))]
        if inputs and label is not None:
            return inputs[0], label
    elif isinstance(sample, (tuple, list)) and len(sample) == 2:
        return sample[0], sample[1]
    raise ValueError(f"dataset {name!r}: a sample is a {type(sample).__name__}; paratrain's job reads (input, label) "
                     "pairs or dicts with 'labels' (or write your own loop with paratrain.Parallel)")


def _infer_info(ds: Dataset, name: str) -> dict[str, Any]:
    """Input shape from the first sample; classes from ``ds.classes``/``ds.num_classes`` or the labels."""
    x, _ = _input_and_label(ds[0], name)  # type: ignore[index]
    num_classes = getattr(ds, "num_classes", None) or len(getattr(ds, "classes", []) or [])
    if not num_classes:
        num_classes = 1 + max(int(torch.as_tensor(_input_and_label(ds[i], name)[1]).max())  # type: ignore[index]
                              for i in range(len(ds)))  # type: ignore[arg-type]
    return {"input_shape": tuple(torch.as_tensor(x).shape), "num_classes": int(num_classes)}


def dataset_info(name: str, data_dir: str | None = None, block_size: int = 256,
                 token_dtype: str = "uint16") -> dict[str, Any]:
    """``{"input_shape": (C, H, W), "num_classes": K}`` for a dataset name, without loading it (a
    user's own dataset, ``file.py:function``, is built from ``data_dir`` and its first sample read);
    for ``tokens:PATH``, ``(block_size,)`` and the vocabulary (:func:`~paratrain.data.tokens.token_vocab`)."""
    if name.startswith("tokens:"):
        from .tokens import token_vocab

        return {"input_shape": (block_size,), "num_classes": token_vocab(token_files(name, True), token_dtype)}
    if name in _INFO:
        info = _INFO[name]
    elif name.startswith("torchvision:") and name.split(":", 1)[1] in _TORCHVISION_INFO:
        info = _TORCHVISION_INFO[name.split(":", 1)[1]]
    elif is_user_spec(name):
        return _infer_info(build_dataset(name, train=True, data_dir=data_dir), name)
    else:
        known = list(DATASET_NAMES) + [f"torchvision:{k}" for k in _TORCHVISION_INFO]
        raise ValueError(f"no shape information for dataset {name!r}: known are {', '.join(known)}")
    return {"input_shape": tuple(info["input_shape"]), "num_classes": int(info["num_classes"])}
