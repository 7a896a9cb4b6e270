"""Tar shards (WebDataset's format) through ``paratrain.data.tar_stream``: every sample once per pass,
lengths from the headers, a resumed run opened at its sample; compressed shards counted and re-read."""

from __future__ import annotations

import io
import tarfile

import pytest
import torch

import paratrain

pytest.importorskip("webdataset")
from paratrain.data.tar import _TarReader, seekable, tar_stream  # noqa: E402


def write_shard(path, ids, mode="w", extra=()):
    """A tar of samples ``{id}.cls`` (the id as text) and ``{id}.x`` (two float32), after the
    ``extra`` members (name, bytes) at its start."""
    with tarfile.open(path, mode) as tf:
        for name, data in extra:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for i in ids:
            for ext, data in (("cls", str(i).encode()), ("x", torch.tensor([float(i), 1.0]).numpy().tobytes())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def decode(sample):
    return {"id": torch.tensor(int(sample["cls"])), "x": torch.frombuffer(bytearray(sample["x"]), dtype=torch.float32)}


def test_tar_shards_are_a_stream_that_seeks(tmp_path):
    """Shards of 10, 0 and 23 samples: every sample once per pass, lengths from the headers, and a
    loader started at step 5 (a resumed run) gives the uninterrupted run's batches from step 5 on."""
    paths = [write_shard(tmp_path / f"shard-{k}.tar", [1000 * k + j for j in range(n)])
             for k, n in enumerate((10, 0, 23))]
    reader = _TarReader(None)
    assert [reader.length(p) for p in paths] == [10, 0, 23] and all(seekable(p) for p in paths)
    first = next(iter(reader.seek(paths[2], 7)))  # opened at its 8th sample's header
    assert first["__key__"] == "002007" and first["cls"] == b"2007" and first["__url__"] == str(paths[2])
    assert [s["__key__"] for s in reader.seek(paths[0], 8)] == ["000008", "000009"]
    meta = write_shard(tmp_path / "meta.tar", [1, 2, 3], extra=[("__meta__/info.json", b"{}")])
    assert reader.length(meta) == 3 and [s["__key__"] for s in reader.seek(meta, 2)] == ["000003"]
    assert list(reader.seek(paths[0], 10)) == []
    pt = paratrain.Parallel(global_batch=4)
    full = [b for _, b in zip(range(12), pt.train_loader(tar_stream(paths, decode, readers=2, tail="next")))]
    assert full[0]["x"].shape == (4, 2)
    ids = [i for b in full[:33 // 4] for i in b["id"].tolist()]
    assert len(set(ids)) == len(ids) == 32  # the first 8 steps: 32 of the 33 samples, none twice
    pt.global_step = 5
    resumed = [b["id"].tolist() for _, b in zip(range(3), pt.train_loader(tar_stream(paths, decode, readers=2,
                                                                                      tail="next")))]
    assert resumed == [b["id"].tolist() for b in full[5:8]]
    pt.close()


def test_compressed_shards_are_counted_once_and_read_from_their_start(tmp_path):
    # told by their first bytes, not their names: a gzip named .tar is compressed, and metadata members
    # (webdataset skips them) are no samples
    paths = [write_shard(tmp_path / f"shard-{k}.tar", [100 * k + j for j in range(n)], "w:gz")
             for k, n in enumerate((5, 3))]
    assert not seekable(paths[0])
    stream = tar_stream(paths, decode)
    assert stream.seek is None  # a resume reads the shard from its start
    assert [s["__key__"] for s in _TarReader(None).seek(paths[0], 3)] == ["000003", "000004"]
    pt = paratrain.Parallel(global_batch=2)
    ids = [i for _, b in zip(range(4), pt.train_loader(stream)) for i in b["id"].tolist()]
    assert sorted(ids) == [0, 1, 2, 3, 4, 100, 101, 102]
    assert (tmp_path / ".paratrain-lengths.json").exists()  # counted once, cached beside the shards
    pt.close()


def test_without_webdataset_it_is_one_line(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_webdataset(name, *args, **kwargs):
        if name.startswith("webdataset"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_webdataset)
    with pytest.raises(ImportError, match=r"pip install 'paratrain\[tar\]' \(or webdataset\)$"):
        tar_stream([tmp_path / "a.tar"])


def test_a_zstd_shard_is_one_line(tmp_path):
    path = tmp_path / "a.tar.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(16))
    with pytest.raises(ValueError, match=r"a.tar.zst is zstd-compressed, which Python's tarfile reads only from "
                                         r"Python 3.14: decompress it"):
        tar_stream([path])
