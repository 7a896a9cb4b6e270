"""``paratrain selftest``: the command as CI runs it, a fault it must catch, and its parts."""

from __future__ import annotations

import json

import pytest
from clitools import run_cli
from pace import scaled

from paratrain.selftest.budget import Budget
from paratrain.selftest.collectives import bus_bandwidth
from paratrain.selftest.correctness import plan_checks
from paratrain.selftest.report import FAIL, OK, SKIPPED, Report
from paratrain.selftest.run import SelftestOptions
from paratrain.selftest.seed import seed_cells, seed_config


def test_selftest_passes_on_this_machine_within_its_budget(tmp_path):
    # what CI proves: the CPU rows run for real, within the budget, and pass. The budget has this
    # machine's room (tests/pace.py); the other sections run in CI's floor step (device_check --dry-run).
    # the rows below; the other strategies' and precisions' rows are the same code, each proven by its
    # own tests (tests/selftest: the layouts; a wrong strategy fails the run). The other pytest worker
    # shares the cores
    budget = round(scaled(50))
    r = run_cli(["selftest", "--budget", str(budget), "--sections", "correctness,collectives,speed", "--strategies",
                 "dp,ddp", "--precisions", "32", "--out", str(tmp_path), "--no-progress"], timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "selftest.json").read_text())
    assert report["passed"] and report["elapsed_s"] <= budget, (report["elapsed_s"], r.stdout[-3000:])
    rows = {(row["section"], row["check"]): row for row in report["rows"]}
    assert rows[("correctness", "ddp x2 32 (CPU)")]["status"] == OK
    assert rows[("correctness", "ddp x2 32 (CPU)")]["data"]["divergence"] <= 1e-5
    assert rows[("correctness", "dp x2 32 (CPU)")]["status"] == SKIPPED  # no GPUs: listed with the reason
    sections = {row["section"] for row in report["rows"]}
    assert {"correctness", "collectives", "speed"} <= sections
    assert any(r["section"] == "collectives" and r["status"] == OK and r["data"]["busbw"] > 0
               for r in report["rows"])
    speed = [r for r in report["rows"] if r["section"] == "speed"]
    assert any(r["check"] == "paratrain ddp x2" and r["status"] == OK for r in speed), speed
    md = (tmp_path / "selftest.md").read_text()
    assert md.startswith("# paratrain selftest") and "| correctness | ddp x2 32 (CPU) | ok |" in md
    assert "selftest: PASS" in r.stdout


def test_selftest_fails_when_a_strategy_trains_wrongly(tmp_path):
    # the fault comes from outside the package (tests/faults/sitecustomize.py): ddp's rank 1 is wrong
    r = run_cli(["selftest", "--budget", "60", "--sections", "correctness", "--strategies", "ddp,fsdp",
                 "--precisions", "32", "--out", str(tmp_path), "--no-progress"], timeout=180,
                PARATRAIN_TEST_WRONG_STRATEGY="ddp")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["check"]: row for row in json.loads((tmp_path / "selftest.json").read_text())["rows"]}
    assert rows["ddp x2 32 (CPU)"]["status"] == FAIL and rows["ddp x2 32 (CPU)"]["data"]["divergence"] > 1e-3
    assert rows["fsdp x2 32 (CPU)"]["status"] == OK
    assert "selftest: FAIL" in r.stdout


def test_bad_values_are_one_line_errors(tmp_path):
    r = run_cli(["selftest", "--budget", "0", "--out", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--budget 0" in r.stderr
    r = run_cli(["selftest", "--sections", "nope", "--out", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and "section 'nope' is unknown" in r.stderr


def test_bus_bandwidth_is_nccl_tests_formula():
    # nccl-tests: all_reduce busbw = algbw * 2(n-1)/n, all_gather busbw = algbw * (n-1)/n
    assert bus_bandwidth("all_reduce", 8e9, 2.0, 8) == (4e9, 4e9 * 14 / 8)
    assert bus_bandwidth("all_gather", 8e9, 2.0, 4) == (4e9, 3e9)
    assert bus_bandwidth("all_reduce", 1e6, 1e-3, 1)[1] == 0.0


def test_budget_sections_share_what_is_left():
    b = Budget(100.0)
    first = b.section(0.25)
    assert 24 < first.left <= 25 and first.allows(20) and not first.allows(30)
    assert 14 < b.section(0.1, at_least=15).left <= 15  # a section that needs 15 s gets them while they are left
    assert 99 < Budget(100.0).section(0.1, at_least=500).left <= 100  # never more than is left
    with pytest.raises(ValueError, match="--budget -1"):
        Budget(-1)


def test_the_budget_judges_later_parts_at_the_pace_measured_here(monkeypatch):
    """A machine that runs parts at twice their estimate skips the parts that would overrun the
    budget at that pace, not at the estimate's (a 120 s budget once took 157 s on a slow machine)."""
    from paratrain.selftest import budget as budget_module

    clock = [0.0]
    monkeypatch.setattr(budget_module.time, "monotonic", lambda: clock[0])
    b = Budget(100.0)
    d = b.section(1.0)
    assert b.pace() == 1.0 and d.allows(60, "run")
    with d.part(10, "run"):
        clock[0] += 20  # twice its estimate
    assert b.pace("run") == 2.0 and b.pace("other kind") == 2.0 and d.expect(10, "run") == 20
    assert not d.allows(45, "run") and d.allows(40, "run")  # 90 s and 80 s here, with 80 s left
    with d.part(10, "fast"):
        clock[0] += 5
    assert b.pace("fast") == 0.5 and b.pace("run") == 2.0  # each kind by its own parts once it has some
    with pytest.raises(RuntimeError), d.part(10, "run"):  # a part that raised still took its time
        clock[0] += 40
        raise RuntimeError
    assert b.pace("run") == 3.0


def _no_probe(precision, device):
    return None


def test_plan_on_simulated_gpu_machines():
    # 4 GPUs: every multi-process check on the GPUs; dp drives all 4 in one process
    checks = plan_checks(["single", "dp", "ddp", "devices"], ["32"], 4, 4, _no_probe)
    assert [(c.strategy, c.world_size, c.accelerator, c.skip) for c in checks] == [
        ("dp", 4, "cuda", None), ("ddp", 4, "cuda", None), ("devices", 1, "cuda", None)]
    # 1 GPU, 2 processes: the N-process runs go to the CPU (gloo), and each strategy also runs on the GPU
    checks = plan_checks(["ddp"], ["32", "bf16-mixed"], 2, 1, lambda p, d: "no bf16" if p != "32" else None)
    assert [(c.label, c.skip) for c in checks] == [
        ("ddp x2 32 (CPU)", None), ("ddp x1 32 (GPU)", None),
        ("ddp x2 bf16-mixed (CPU)", "no bf16"), ("ddp x1 bf16-mixed (GPU)", "no bf16")]


def test_seed_table_cells_name_what_this_machine_cannot_run():
    cfg = seed_config(gpus=0)
    cells = seed_cells(cfg, world=2, gpus=0)
    labels = {c.label: c.skip for c in cells}
    assert labels["single"] is None and labels["ddp x2"] is None and labels["ddp x2 bf16-mixed"] is None
    assert "2 GPUs" in labels["dp x2"]
    assert "fp16" in labels["ddp x2 fp16-mixed"]
    assert cfg.model == "resnet50" and cfg.data.dataset == "synthetic"


def test_report_files_and_exit_rule(tmp_path):
    rep = Report(budget_s=10)
    rep.add("correctness", "ddp x2 32 (CPU)", OK, "fine")
    rep.add("speed", "x", FAIL, "slow | odd")
    assert not rep.failed  # only a correctness failure fails the command
    rep.add("correctness", "fsdp x2 32 (CPU)", FAIL, "diverged")
    assert [r.check for r in rep.failed] == ["fsdp x2 32 (CPU)"]
    paths = rep.write(str(tmp_path))
    assert json.loads(open(paths["json"]).read())["passed"] is False
    assert "slow \\| odd" in open(paths["md"]).read()


def test_options_are_checked_up_front():
    with pytest.raises(ValueError, match="strategy 'zero' is unknown"):
        SelftestOptions(strategies=["zero"])
    assert SelftestOptions(precisions=["fp32", "32", "bf16"]).precisions == ["32", "bf16-mixed"]


def test_a_speed_launch_that_fails_once_is_tried_again_and_says_so(monkeypatch):
    from paratrain.launch.spawn import LaunchError
    from paratrain.selftest import speed

    calls = []

    def flaky(fn, world, args, timeout, env, **how):  # the first launch fails as a taken port would
        calls.append(world)
        if len(calls) == 1:
            raise LaunchError("rank 0 failed: DistNetworkError: address already in use")
        walls = {"hand-written": [[0.010, 0.010], [0.010, 0.010]], "paratrain": [[0.011, 0.011], [0.010, 0.012]]}
        return [{"rank": r, "wall": walls} for r in range(world)]

    monkeypatch.setattr(speed, "FRAMEWORKS", {})
    monkeypatch.setattr(speed, "launch", flaky)
    report = Report(budget_s=60)
    speed.run_speed(report, 2, "cpu", Budget(60).section(1.0), {"model": "cnn", "global_batch": 64}, steps=4)
    rows = {r.check: r for r in report.rows}
    assert len(calls) == 2 and rows["paratrain ddp x2"].status == OK
    assert "second try, the first failed: rank 0 failed: DistNetworkError" in rows["hand-written DDP x2"].result

    def broken(fn, world, args, timeout, env, **how):
        calls.append(world)
        raise LaunchError("boom")

    calls.clear()
    monkeypatch.setattr(speed, "launch", broken)
    report = Report(budget_s=60)
    speed.run_speed(report, 2, "cpu", Budget(60).section(1.0), {"model": "cnn", "global_batch": 64}, steps=4)
    assert len(calls) == 2 and [(r.check, r.status, r.result) for r in report.rows] == [
        ("overhead ddp x2", FAIL, "boom; then boom")]


def test_layouts_plan_one_per_set_of_dimensions():
    from paratrain.selftest.correctness import plan_layouts

    assert [(c.label, c.skip is not None) for c in plan_layouts(2, 0)] == [("2-D layouts x2 32 (CPU)", True)]
    four = [c.mesh for c in plan_layouts(4, 0)]
    assert sorted(four) == sorted(["dp_replicate=2,dp_shard=2", "dp_shard=2,tp=2", "dp_replicate=2,tp=2",
                                   "pp=2,dp_shard=2", "pp=2,dp_replicate=2", "pp=2,tp=2"])
    eight = [c.mesh for c in plan_layouts(8, 0)]
    assert eight[:3] == ["dp_replicate=2,dp_shard=2,tp=2", "pp=2,dp_replicate=2,dp_shard=2",
                         "pp=2,dp_shard=2,tp=2"] or set(eight[:4]) >= {"pp=2,dp_shard=2,tp=2"}
    assert all(c.skip is None and c.model == "transformer" for c in plan_layouts(8, 0))


def test_selftest_proves_layouts_at_four_processes(tmp_path):
    # what the layouts section runs for real: composed meshes of the built-in transformer against
    # one process; the budget decides how many (at least the first), none may fail
    r = run_cli(["selftest", "--budget", str(round(scaled(17))), "--sections", "layouts", "--nproc-per-node", "4",
                 "--out", str(tmp_path), "--no-progress"], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [row for row in json.loads((tmp_path / "selftest.json").read_text())["rows"] if row["section"] == "layouts"]
    ran = [row for row in rows if row["status"] == OK]
    assert ran and all(row["data"]["divergence"] <= 1e-5 for row in ran), rows
    assert all(row["status"] in (OK, SKIPPED) for row in rows), rows
