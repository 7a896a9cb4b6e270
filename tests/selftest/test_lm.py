"""``paratrain selftest --sections lm``: the language-model rows (paratrain/selftest/lm.py).

The GPU run (GPT-2 124M, compiled) is the device check's ``lm`` step; here its CPU twin runs every
loop for real and the numbers are checked against the step times they come from."""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.models.gpt import GPT, GPTConfig, flops_per_token, token_loss
from paratrain.selftest.budget import Budget
from paratrain.selftest.lm import GOAL, LMJob, lm_job, lm_rows, nanogpt_adamw, peak_bf16_flops, plain_steps, run_lm
from paratrain.selftest.report import FAIL, OK, SKIPPED, Report


def test_the_gpu_job_is_gpt2_124m_compiled_and_the_twin_is_tiny() -> None:
    gpu = lm_job("cuda")
    assert gpu.config == GPTConfig() and (gpu.config.n_layer, gpu.config.n_embd, gpu.config.block_size,
                                          gpu.config.vocab_size) == (12, 768, 1024, 50304)
    assert gpu.compile and gpu.loops == ("plain", "single", "ddp", "fsdp")
    assert lm_job("cuda", "fp16-mixed").loops == ("plain", "single", "ddp")
    twin = lm_job("cpu", frameworks=("accelerate",))
    assert not twin.compile and twin.frameworks == ("accelerate",) and twin.config.n_layer == 2
    assert lm_job("cuda", "fp8-mixed").loops == ("plain", "single")  # fp8 single against the plain loop in bf16
    with pytest.raises(ValueError, match="bf16-mixed, fp16-mixed, fp8-mixed, not '32'"):
        LMJob(config=GPTConfig(), batch=1, precision="32", compile=False, steps=1, block=1, warmup=0)


def test_tokens_per_second_mfu_and_the_ratio_come_from_the_step_times() -> None:
    job = lm_job("cpu")
    # the plain loop 0.1 s a step, paratrain 0.101 s, in two rounds of two steps
    result = {"wall": {"plain": [[0.1, 0.1], [0.1, 0.1]], "single": [[0.101, 0.101], [0.102, 0.1]]},
              "peak_bytes": {"plain": 3 * 2**20, "single": 2**20}, "peak_flops": 1e12}
    plain, single = lm_rows(job, result)
    assert plain.tokens_per_s == pytest.approx(job.tokens_per_step / 0.1) and plain.ratio is None
    with torch.device("meta"):
        per_token = flops_per_token(GPT(job.config))
    assert plain.mfu == pytest.approx(per_token * plain.tokens_per_s / 1e12) and plain.peak_mib == 3
    assert single.ratio == pytest.approx(0.1 / 0.101) and single.rounds == pytest.approx([0.1 / 0.101, 0.1 / 0.101])
    assert lm_rows(job, {**result, "peak_flops": None})[0].mfu is None


def test_the_peak_is_the_devices_dense_bf16_peak_by_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    names = {"NVIDIA H200": 989.5e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 80GB HBM3": 989.5e12,
             "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA GeForce RTX 4090": 165.2e12, "Some New GPU": None}
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_bf16_flops(torch.device("cuda", 0)) == (peak, name)
    assert peak_bf16_flops(torch.device("cpu")) == (None, "cpu")


def test_the_plain_loop_is_nanogpts_and_uses_the_fused_adamw_on_cuda() -> None:
    model = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=1, n_embd=8))
    opt = nanogpt_adamw(model, "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    assert opt.defaults["lr"] == 6e-4 and opt.defaults["betas"] == (0.9, 0.95) and not opt.defaults["fused"]
    # the plain loop's steps equal the same steps written out (autocast bf16, clip at 1.0)
    job = LMJob(config=model.config, batch=2, precision="bf16-mixed", compile=False, steps=2, block=1, warmup=0)
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    batches = [(ids[:, :-1], ids[:, 1:])]
    loop = plain_steps(job, torch.device("cpu"), batches)
    net = next(loop)
    losses = [float(next(loop)) for _ in range(2)]
    torch.manual_seed(0)
    ref = GPT(model.config)
    ref_opt = nanogpt_adamw(ref, "cpu")
    want = []
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = token_loss(ref(batches[0][0]), batches[0][1])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        want.append(float(loss.detach()))
    assert losses == want
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), ref.state_dict().values()))


def test_the_cpu_twin_runs_every_loop_in_both_precisions_and_their_losses_agree() -> None:
    report = Report()
    rows = run_lm(report, "cpu", Budget(300).section(1.0))
    by = {(r.check, r.status) for r in report.rows}
    assert not [r for r in report.rows if r.status == FAIL], report.table()
    checks = {r.check for r in report.rows if r.status == OK}
    for loop in ("plain loop (nanoGPT train.py)", "paratrain single", "paratrain ddp x1", "paratrain fsdp x1"):
        assert f"{loop} bf16-mixed" in checks, by
    assert {"plain loop (nanoGPT train.py) fp16-mixed", "paratrain single fp16-mixed"} <= checks, by
    for name in ("Accelerate", "Lightning Fabric"):  # ran where they import, else listed with the reason
        assert f"{name} bf16-mixed" in checks or any(r.check == f"{name} bf16-mixed" and r.status == SKIPPED
                                                      for r in report.rows), by
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["mfu"] is None and math.isfinite(r["peak_mib"])
        assert (r["ratio"] is None) == (r["loop"] == "plain")
    assert all("speed not judged" in r.result for r in report.rows if r.status == OK and "tokens/s" in r.result)
    agree = [r for r in report.rows if r.check.startswith("losses agree")]
    assert [(r.check, r.status) for r in agree] == [("losses agree bf16-mixed", OK), ("losses agree fp16-mixed", OK)]
    assert "within 5% of the plain loop's" in agree[0].result
    # fp8-mixed: refused here with the reason, in its row
    (fp8,) = [r for r in report.rows if r.check == "LM rows fp8-mixed"]
    assert fp8.status == SKIPPED and fp8.result.startswith("precision fp8-mixed needs a CUDA GPU"), fp8
    assert GOAL == 0.98


def test_a_budget_too_small_skips_the_rows_with_the_reason() -> None:
    report = Report()
    assert run_lm(report, "cpu", Budget(1).section(1.0)) == []
    budget = [r for r in report.rows if r.result.startswith("budget:")]
    assert [(r.check, r.status) for r in budget] == [("LM rows bf16-mixed", SKIPPED), ("LM rows fp16-mixed", SKIPPED)]


def test_a_later_precision_that_would_not_fit_is_skipped_by_the_worker_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import torch.distributed as dist

    from paratrain.selftest import lm

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)

    def run_job(job, device):  # every job's loops take 0.5 s: 6 loops for bf16, 2 for the twin's fp16
        time.sleep(0.5)
        return {"wall": {}, "precision": job.precision}

    monkeypatch.setattr(lm, "run_job", run_job)
    jobs = [lm_job("cpu", frameworks=("accelerate", "lightning")), lm_job("cpu", "fp16-mixed")]
    # the first job always runs (run_lm checked that it fits); the second would end 0.17 s after `until`
    first, second = lm.lm_worker(0, jobs, until=time.time() + 0.6)
    assert first["precision"] == "bf16-mixed"
    assert second["skipped"].startswith("budget: 0 s left, its 2 loops take about 0 s here"), second
    first, second = lm.lm_worker(0, jobs, until=time.time() + 5)  # both fit
    assert second["precision"] == "fp16-mixed"
