"""``paratrain verify``: PASS on a correct job, FAIL naming the cause on the classic mistakes."""

import os

import pytest
import torch

from clitools import run_cli
from paratrain.verify import VerifyOptions, compare_runs
from paratrain.verify.diagnose import RunView, diagnose
from paratrain.verify.worker import load_entry

ENTRY = os.path.join("tests", "scripts", "verify_entry.py")
LIMIT = ["--timeout", "80"]  # per run: a hung run fails with its stack trace instead of hitting the test's limit


def _view(name, world, samples, fingerprints, lr=0.1, unused=(), checksum=1.0, bn=()):
    return RunView(name=name, world_size=world, samples=samples, fingerprints=fingerprints, lrs=[lr] * len(samples),
                   unused=list(unused), init_checksum=checksum, unsynced_bn=list(bn))


def test_compare_runs_reports_relative_divergence_per_tensor():
    ref = {"w": torch.ones(4), "n": torch.tensor(3)}
    got = {"w": torch.ones(4) * (1 + 1e-3), "n": torch.tensor(3)}
    c = compare_runs("x", got, ref, 1e-5, [1.0, 0.5], [1.0, 0.5])
    # 1 + 1e-3 in float32 is off by up to 6e-8, i.e. 6e-5 of the 1e-3 divergence: rel 1e-3 is 16x that
    assert not c.passed and c.worst.name == "w" and c.worst.divergence == pytest.approx(1e-3, rel=1e-3)
    assert c.loss_divergence == 0.0
    assert compare_runs("x", ref, ref, 1e-5).passed


def test_a_nan_anywhere_in_the_loss_curve_is_a_divergence():
    ref = {"w": torch.ones(2)}
    nan = float("nan")
    assert compare_runs("x", ref, ref, 1e-5, [1.0, nan], [1.0, 0.5]).loss_divergence == float("inf")
    assert compare_runs("x", ref, ref, 1e-5, [nan, 0.5], [1.0, 0.5]).loss_divergence == float("inf")
    assert compare_runs("x", ref, ref, 1e-5, [1.0, float("inf")], [1.0, float("inf")]).loss_divergence == 0.0


def test_diagnose_without_samples_at_world_size_1_names_no_batch_change():
    ref = _view("world size 1", 1, [0], [[]])
    run = _view("world size 2", 2, [8], [[1, 2, 3, 4, 5, 6, 7, 8]])
    assert "effective batch changed with world size" not in {f.cause for f in diagnose(ref, [run], set())}


def test_a_tensor_whose_gradient_is_rounding_noise_is_not_counted():
    # BERT's attention key bias: softmax ignores it, its gradient is ~1e-13, and AdamW turns that
    # noise into lr-sized steps whose signs differ between world sizes
    view = RunView(name="ref", world_size=1, grad_norms={"w": 2.0, "key.bias": 1e-13})
    assert view.noise_gradients() == {"key.bias"}
    ref = {"w": torch.ones(4), "key.bias": torch.full((4,), 1e-3)}
    got = {"w": torch.ones(4), "key.bias": torch.full((4,), -1e-3)}
    assert not compare_runs("x", got, ref, 1e-5).passed
    c = compare_runs("x", got, ref, 1e-5, noise=view.noise_gradients())
    assert c.passed and c.worst.name == "w" and [t.noise for t in c.tensors] == [False, True]
    got["key.bias"] = torch.full((4,), float("nan"))  # a NaN is never rounding noise
    assert not compare_runs("x", got, ref, 1e-5, noise=view.noise_gradients()).passed


def test_the_probe_counts_keyword_inputs():
    from paratrain.verify.probe import Probe

    class KwargsNet(torch.nn.Module):  # a HuggingFace-style model(**batch)
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, input_ids=None, labels=None):
            return {"loss": torch.nn.functional.cross_entropy(self.fc(input_ids), labels)}

    net = KwargsNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    probe = Probe().install()
    try:
        net(input_ids=torch.randn(5, 3), labels=torch.zeros(5, dtype=torch.long))["loss"].backward()
        opt.step()
    finally:
        probe.remove()
    assert [s["samples"] for s in probe.steps] == [5] and set(probe.grad_norms) == {"fc.weight", "fc.bias"}


def test_diagnose_names_data_order_seeding_and_unused_parameters():
    ref = _view("world size 1", 1, [4, 4], [[1, 2, 3, 4], [5, 6, 7, 8]], unused=["head.weight"])
    shuffled = _view("world size 2", 2, [4, 4], [[1, 2, 3, 5], [4, 6, 7, 8]])
    repeat = _view("repeat", 1, [4, 4], [[1, 2, 3, 5], [4, 6, 7, 8]], checksum=2.0)
    causes = {f.cause: f for f in diagnose(ref, [shuffled], {"world size 2"}, repeat)}
    assert "optimizer step 0" in causes["data order differs across world sizes"].message
    assert "data order not seeded" in causes and "model initialisation not seeded" in causes
    assert "head.weight" in causes["parameters unused in backward"].message
    assert not causes["parameters unused in backward"].fail  # a warning while the N run did not fail


def test_diagnose_names_dropout_when_world_size_n_differs():
    ref = _view("world size 1", 1, [4], [[1, 2, 3, 4]])
    run = _view("world size 2", 2, [4], [[1, 2, 3, 4]])
    run.dropout = ["encoder.dropout"]
    causes = {f.cause: f for f in diagnose(ref, [run], {"world size 2"})}
    finding = causes["dropout masks differ across world sizes"]
    assert "encoder.dropout" in finding.message and "p=0" in finding.message and not finding.fail
    assert "dropout masks differ across world sizes" not in {f.cause for f in diagnose(ref, [run], set())}


def test_diagnose_lr_scaled_with_batch_is_only_a_warning():
    ref = _view("world size 1", 1, [4], [[1, 2, 3, 4]], lr=0.1)
    grown = _view("world size 2", 2, [8], [[1, 2, 3, 4, 5, 6, 7, 8]], lr=0.2)
    causes = {f.cause: f for f in diagnose(ref, [grown], {"world size 2"})}
    assert causes["effective batch changed with world size"].fail
    assert not causes["learning rate scaled with the batch"].fail
    assert "learning rate not scaled when the batch was" not in causes


def test_bad_values_are_one_line_errors():
    with pytest.raises(ValueError, match="at least 2"):
        VerifyOptions(world_size=1)
    with pytest.raises(ValueError, match="no function 'nope'"):
        load_entry(f"{ENTRY}:nope")
    r = run_cli(["verify", "--entry", "no_such_module_xyz:train"], timeout=60)
    assert r.returncode == 2 and "cannot import module 'no_such_module_xyz'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli(["verify", "--nproc", "3", "--global-batch", "64"], timeout=60)
    assert r.returncode == 2 and "not divisible by world size 3" in r.stderr
    r = run_cli(["verify", "--entry", f"{ENTRY}:global_batch", "--model", "mlp", "--sync-bn"],
                timeout=60)  # options of a built-in job would be silently ignored: refused instead
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--model, --sync-bn would be ignored; drop them" in r.stderr
    r = run_cli(["verify", "--entry", f"{ENTRY}:global_batch", "--strategy", "nope"], timeout=60)
    assert r.returncode == 2 and "strategy 'nope' is unknown" in r.stderr, r.stderr


# ps: the server's own optimizer steps are not the loop's; tensor, pipeline: both ranks read the same batch
@pytest.mark.parametrize("strategy", ["ddp", "ps", "tensor", "pipeline"])
def test_verify_passes_on_a_correct_config(strategy):
    r = run_cli(["verify", "--nproc", "2", "--steps", "6", "--model", "mlp", "--strategy", strategy, *LIMIT],
                timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert f"world size 2 ({strategy}) vs world size 1" in out and "world size 1, accumulation 2 vs world size 1" in out
    assert "fc1.weight" in out and "result: PASS" in out and "FAIL" not in out
    assert "ok: effective batch: 64 samples per optimizer step" in out


def test_verify_fails_on_unsynced_batchnorm():
    r = run_cli(["verify", "--nproc", "2", "--steps", "4", "--model", "cnn", "--check-accumulation", "0", *LIMIT],
                timeout=280)
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "FAIL: BatchNorm not synced across ranks" in r.stdout
    assert "features.1" in r.stdout and "--sync-bn" in r.stdout
    assert "result: FAIL" in r.stdout


def test_verify_fails_on_a_script_that_grows_the_batch_with_the_world_size():
    r = run_cli(["verify", "--nproc", "2", "--steps", "5", "--entry", f"{ENTRY}:grow_batch", *LIMIT], timeout=280)
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "FAIL: effective batch changed with world size: 32 samples per optimizer step at world size 1 " \
           "but 64 at world size 2" in r.stdout
    assert "FAIL: learning rate not scaled when the batch was" in r.stdout
    assert "result: FAIL" in r.stdout


def test_verify_passes_on_a_script_that_keeps_the_global_batch():
    r = run_cli(["verify", "--nproc", "2", "--steps", "5", "--entry", f"{ENTRY}:global_batch", *LIMIT], timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "result: PASS" in r.stdout and "ok: data order" in r.stdout



def test_verify_hands_strategy_precision_and_accumulation_to_a_parallel_loop():
    r = run_cli(["verify", "--nproc", "2", "--steps", "4", "--entry", f"{ENTRY}:parallel_loop", "--strategy", "fsdp",
                 "--check-accumulation", "2", "--also-precision", "bf16-mixed", *LIMIT], timeout=280)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    for line in ("world size 2 (fsdp) vs world size 1: largest", "world size 1, accumulation 2 vs world size 1: largest",
                 "world size 1, bf16-mixed vs world size 1: largest"):
        assert line in r.stdout, r.stdout
    assert "result: PASS" in r.stdout and "FAIL" not in r.stdout


def test_a_function_that_does_not_take_what_verify_hands_it_is_named():
    from paratrain.verify.check import _check_taken
    from paratrain.verify.diagnose import RunView

    def checked(parallel, **asked):
        run = RunView(name="r", world_size=2, parallel=parallel)
        _check_taken(run, asked, 2)
        return run.error

    took = [{"strategy": "fsdp", "precision": "32", "accumulation": 1}]
    assert checked(took, strategy="fsdp") is None
    assert checked([{**took[0], "strategy": "ddp"}], strategy="auto") is None  # auto: ddp on 2 processes
    assert checked([], strategy="fsdp", accumulation=2) == (
        "the function built no paratrain.Parallel, so --strategy, --check-accumulation could not reach it: "
        "--strategy, --check-accumulation apply to a loop built on Parallel(); drop them")
    assert checked(took, strategy="fsdp", accumulation=2) == (
        "the function's Parallel ran accumulation 1, not 2: it sets accumulation= itself (drop that, or "
        "--check-accumulation)")


def test_ranks_that_share_a_shard_count_its_samples_once():
    # tensor/pipeline: both ranks' Parallel read the same batches; only the shard's leader counts them
    def rank(r, leader):
        step = {"samples": 32, "fingerprints": [float(r)], "lr": 0.1}
        return {"rank": r, "state": {}, "losses": None, "probe": {"steps": [step], "unused": [], "init_checksum": 1.0},
                "unsynced_bn": [], "parallel": [{"strategy": "tensor", "data_parallel_leader": leader}]}

    view = RunView.merge("world size 2 (tensor)", 2, [rank(0, True), rank(1, False)])
    assert view.samples == [32] and view.fingerprints == [[0.0]]
    plain = RunView.merge("world size 2", 2, [{**rank(r, True), "parallel": []} for r in (0, 1)])
    assert plain.samples == [64]  # a hand-written loop's ranks each read their own samples


def test_the_probe_survives_a_forward_that_raises():
    import warnings

    from torch import nn

    from paratrain.verify.probe import Probe

    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("on purpose")

    probe = Probe().install()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns when an always_call hook raises in the error path
            with pytest.raises(RuntimeError, match="on purpose"):
                nn.Sequential(nn.Linear(2, 2), Boom())(torch.ones(1, 2))
    finally:
        probe.remove()
    assert probe._depth == 0
