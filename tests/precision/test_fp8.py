"""``fp8-mixed``: torchao's Float8 training where the GPU has float8 tensor cores, refused in one line
everywhere else. The GPU row (speed and loss against bf16-mixed) is the device check's; here the
refusals, and the conversion up to the first float8 kernel on a simulated Hopper GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from clitools import run_cli
from torch import nn

import paratrain
from paratrain import precision
from paratrain.config import ParallelConfig
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.precision.fp8 import FP8Mixed, float8_filter, float8_unsupported


def _gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return torch.device("cuda", 0)


def test_the_name_and_its_alias() -> None:
    assert precision.resolve("fp8") == "fp8-mixed" and precision.lookup("fp8-mixed") is FP8Mixed
    assert FP8Mixed.float8 and FP8Mixed.autocast and FP8Mixed.dtype == torch.bfloat16
    assert "fp8-mixed" not in precision.bench_defaults()  # only where the GPU has it: not in bench's matrices


def test_on_the_cpu_it_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^precision fp8-mixed needs a CUDA GPU of compute capability 8\.9 or newer "
                                         r"\(Ada, Hopper, Blackwell\), and this run is on cpu: use bf16-mixed$"):
        paratrain.Parallel(precision="fp8-mixed")


def test_the_command_line_refuses_it_on_the_cpu_in_one_line(tmp_path) -> None:
    r = run_cli(["train", "--precision", "fp8", "--max-steps", "1", "--no-progress", "--log-dir", str(tmp_path)],
                timeout=60)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("paratrain")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert "precision fp8-mixed needs a CUDA GPU" in lines[0] and "use bf16-mixed" in lines[0]


def test_bench_and_selftest_skip_its_cells_with_the_reason_instead_of_starting_them() -> None:
    from paratrain.bench.matrix import _probe_precision

    assert FP8Mixed.unsupported(torch.device("cpu")) == float8_unsupported(torch.device("cpu"))
    assert _probe_precision("fp8-mixed", "cpu").startswith("precision fp8-mixed needs a CUDA GPU")
    assert _probe_precision("bf16-mixed", "cpu") is None


def test_an_older_gpu_is_refused_with_its_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    device = _gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    assert float8_unsupported(device) == ("precision fp8-mixed needs compute capability 8.9 or newer, and NVIDIA "
                                          "A100-SXM4-80GB is 8.0: use bf16-mixed")
    with pytest.raises(ValueError, match="NVIDIA A100-SXM4-80GB is 8.0"):
        FP8Mixed(device)


def test_without_torchao_it_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    device = _gpu(monkeypatch, (9, 0), "NVIDIA H200")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert float8_unsupported(device) == ("precision fp8-mixed needs torchao (its Float8 training): "
                                          "pip install 'paratrain[fp8]'")


@pytest.mark.parametrize("strategy", ["tensor", "pipeline", "ps", "dp"])
def test_strategies_that_split_or_copy_the_linears_refuse_it(strategy: str) -> None:
    with pytest.raises(ValueError, match=rf"precision fp8-mixed \(torchao's Float8 linears\) is not supported with "
                                         rf"strategy {strategy}: use single, ddp or fsdp"):
        ParallelConfig(strategy=strategy, precision="fp8-mixed")


def test_the_filter_keeps_the_head_and_odd_sizes_in_bf16() -> None:
    assert float8_filter(nn.Linear(64, 128), "transformer.h.0.mlp.c_fc")
    assert not float8_filter(nn.Linear(64, 10), "fc2")  # 10 is no multiple of 16
    assert not float8_filter(nn.Linear(64, 512), "lm_head") and not float8_filter(nn.Linear(64, 512), "output")
    assert not float8_filter(nn.Conv2d(16, 16, 3), "conv")


def test_on_a_hopper_gpu_the_linears_become_float8_up_to_the_first_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    plugin = FP8Mixed(_gpu(monkeypatch, (9, 0), "NVIDIA H200"))
    with pytest.warns(UserWarning, match="the widest float8 linear is 32 wide; below about 4096"):
        model = plugin.setup_model(GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)))
    kinds = {name: type(m) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds["transformer.h.0.attn.c_attn"] is Float8Linear and kinds["transformer.h.1.mlp.c_proj"] is Float8Linear
    assert kinds["lm_head"] is nn.Linear  # the head (tied to the embedding) stays in bf16
    with pytest.raises(ValueError, match="found no nn.Linear with both sizes a multiple of 16"):
        plugin.setup_model(nn.Sequential(nn.Linear(10, 3)))
