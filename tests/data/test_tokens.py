"""Token files (nanoGPT's ``train.bin``) as :class:`~paratrain.data.TokenWindows`: windows that tile
each file, next-token targets, random offsets drawn from (seed, epoch, index); a micro-batch read at
once equals its samples read one by one; the same global batches at world size 1 and 2, with and
without DataLoader workers; ``paratrain train --dataset tokens:PATH --model gpt`` learns a file."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import paratrain
from paratrain.data import TokenWindows
from paratrain.data.datasets import dataset_info


def write(path, tokens, dtype=np.uint16):
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def test_contiguous_windows_tile_each_file_with_next_token_targets(tmp_path):
    a = write(tmp_path / "a.bin", np.arange(0, 50))  # 49 // 8 = 6 windows
    b = write(tmp_path / "b.bin", np.arange(1000, 1017))  # 16 // 8 = 2: no window crosses a file's end
    ds = TokenWindows([a, b], block_size=8)
    assert len(ds) == 8
    x, y = ds[0]
    assert x.dtype == torch.int64 and x.tolist() == list(range(8)) and y.tolist() == list(range(1, 9))
    assert ds[5][0].tolist() == list(range(40, 48)) and ds[7][1].tolist() == list(range(1009, 1017))
    xs, ys = ds[[7, 0, 5]]  # a micro-batch at once: the samples one by one, stacked
    assert torch.equal(xs, torch.stack([ds[i][0] for i in (7, 0, 5)]))
    assert torch.equal(ys, torch.stack([ds[i][1] for i in (7, 0, 5)]))
    with pytest.raises(IndexError, match="out of range 0..7"):
        ds[[8]]


def test_random_windows_come_from_the_seed_the_epoch_and_the_index(tmp_path):
    path = write(tmp_path / "t.bin", np.arange(3000) % 60000, np.uint32)
    ds = TokenWindows(path, 16, dtype="uint32", windows="random", seed=3)
    assert len(ds) == 2999 // 16

    class Epoch(list):
        epoch = 1

    first = ds[list(range(64))][0][:, 0]
    assert torch.equal(first, ds[list(range(64))][0][:, 0])  # the same draw again
    assert torch.equal(ds[[5]][0], ds[5][0].unsqueeze(0))
    other = ds[Epoch(range(64))][0][:, 0]
    assert not torch.equal(first, other)  # another epoch, other offsets
    assert int(first.min()) >= 0 and int(first.max()) <= 3000 - 17 and len(set(first.tolist())) > 50
    assert not torch.equal(TokenWindows(path, 16, "uint32", "random", seed=4)[list(range(8))][0], ds[list(range(8))][0])


def test_token_file_errors_are_one_line(tmp_path):
    path = write(tmp_path / "t.bin", np.arange(11))
    with pytest.raises(ValueError, match="holds 11 tokens, fewer than one window of 16 \\+ 1"):
        TokenWindows(path, 16)
    with pytest.raises(ValueError, match="token dtype 'uint8'"):
        TokenWindows(path, 4, dtype="uint8")
    with pytest.raises(ValueError, match="not a whole number of uint32 tokens"):
        TokenWindows(write(tmp_path / "odd.bin", np.arange(3)), 1, dtype="uint32")  # 6 bytes
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenWindows(tmp_path / "missing.bin", 4)
    with pytest.raises(FileNotFoundError, match="the folder has no train.bin"):
        dataset_info(f"tokens:{tmp_path}")  # a folder needs nanoGPT's train.bin and val.bin
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dataset_info(f"tokens:{tmp_path / 'nothing'}")


def test_packed_documents_get_their_positions_documents_and_a_mask(tmp_path):
    """A file of documents ended by an end-of-text token (nanoGPT's layout): each window says which
    document each position belongs to, and the mask keeps attention causal and within a document;
    with it, a document's logits do not depend on the document before it."""
    from paratrain.data.tokens import document_mask
    from paratrain.models.gpt import GPT, GPTConfig

    EOS = 9
    tokens = [1, 2, EOS, 3, 4, 5, EOS, 6, EOS]  # documents [1 2 EOS] [3 4 5 EOS] [6 EOS]
    ds = TokenWindows(write(tmp_path / "t.bin", tokens * 3), block_size=8, eos=EOS)
    x, y, docs = ds[0]
    assert x.tolist() == [1, 2, EOS, 3, 4, 5, EOS, 6] and docs.tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    xs, ys, ds_ = ds[[0, 1]]
    mask = document_mask(ds_)
    assert mask.shape == (2, 1, 8, 8) and mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False]
    # the second document's attention, masked: the same as the document alone
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=2, n_embd=8))
    attn = model.transformer.h[0].attn
    h = torch.randn(1, 8, 8)
    B, T, C = h.shape
    q, k, v = attn.c_attn(h).split(8, dim=2)
    q, k, v = (t.view(B, T, 2, 4).transpose(1, 2) for t in (q, k, v))
    masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs[None]))
    alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, 3:7], k[:, :, 3:7], v[:, :, 3:7], is_causal=True)
    torch.testing.assert_close(masked[:, :, 3:7], alone)


def first_tokens(rank, path, workers):
    pt = paratrain.Parallel(global_batch=8, seed=1)
    loader = pt.train_loader(TokenWindows(path, 4, windows="random", seed=2), num_workers=workers)
    out = [batch[0][:, 0].tolist() for _, batch in zip(range(6), loader)]
    pt.close()
    return out


def test_the_same_global_batches_at_world_size_one_and_two(tmp_path):
    path = write(tmp_path / "t.bin", np.arange(400))  # token = position: a window's first token names it
    one = first_tokens(0, path, 0)
    assert one == first_tokens(0, path, 2)  # DataLoader workers read the same
    two = paratrain.launch(first_tokens, nprocs=2, args=(path, 1), timeout=120)
    assert [sorted(a + b) for a, b in zip(*two)] == [sorted(s) for s in one]


def test_paratrain_train_learns_a_token_file(tmp_path):
    """The built-in GPT on a folder in nanoGPT's layout: the loss falls on a repeating sequence, and
    the vocabulary comes from the file (its largest id + 1)."""
    pattern = np.tile(np.arange(24), 200)
    write(tmp_path / "train.bin", pattern)
    write(tmp_path / "val.bin", pattern[:800])
    assert dataset_info(f"tokens:{tmp_path}", block_size=16) == {"input_shape": (16,), "num_classes": 24}
    out = subprocess.run([sys.executable, "-m", "paratrain", "train", "--dataset", f"tokens:{tmp_path}", "--model",
                          "gpt", "--set", "data.block_size=16", "--global-batch", "16", "--max-steps", "40",
                          "--optimizer", "adamw", "--lr", "0.003", "--no-progress",
                          "--log-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["test_accuracy"] is None and result["test_loss"] < 0.5 * np.log(24)  # it learnt the sequence
    assert "test loss" in out.stdout


def _final(directory):
    from paratrain.checkpoint import load_latest

    _, state = load_latest(directory)
    return state["global_step"], state["model"]


@pytest.mark.timeout(400)
def test_a_token_run_killed_mid_epoch_or_moved_to_another_world_size_ends_on_the_same_weights(tmp_path):
    """The built-in GPT on a token file, 2 processes, 12 steps (an epoch is 15): a worker killed at
    step 6 and restarted (``--max-restarts``) resumes from step 4 and ends on the uninterrupted
    run's weights; a run of one process to step 8, resumed on two, ends on them too."""
    from clitools import run_cli
    from parity import assert_same_state

    pattern = np.tile(np.arange(24), 80)  # 1920 tokens: 119 windows of 16, 14 global batches of 8
    write(tmp_path / "train.bin", pattern)
    write(tmp_path / "val.bin", pattern[:200])
    common = ["train", "--dataset", f"tokens:{tmp_path}", "--model", "gpt", "--set", "data.block_size=16",
              "--global-batch", "8", "--checkpoint-every", "4", "--no-progress", "--lr", "0.1", "--strategy", "ddp"]
    # SGD (the default): Adam would divide float32 rounding in near-zero gradients by their own size
    ref = run_cli([*common, "--nproc-per-node", "2", "--max-steps", "12", "--log-dir", str(tmp_path / "ref")],
                  timeout=150)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = run_cli([*common, "--nproc-per-node", "2", "--max-steps", "12", "--log-dir", str(tmp_path / "kill"),
                      "--max-restarts", "1"], timeout=180, PARATRAIN_TEST_KILL_AT="1:6")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "resumed from step 4" in killed.stdout
    step, expected = _final(tmp_path / "ref" / "checkpoints")
    assert step == 12
    assert_same_state(_final(tmp_path / "kill" / "checkpoints")[1], expected, rtol=1e-6)  # same world, same sums
    one = run_cli([*common, "--nproc-per-node", "1", "--max-steps", "8", "--log-dir", str(tmp_path / "moved")],
                  timeout=150)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli([*common, "--nproc-per-node", "2", "--max-steps", "12", "--log-dir", str(tmp_path / "moved"),
                   "--resume"], timeout=150)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "resumed from step 8" in two.stdout
    assert_same_state(_final(tmp_path / "moved" / "checkpoints")[1], expected, rtol=1e-4)  # float32 sums regrouped
