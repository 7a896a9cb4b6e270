"""``scripts/device_check.sh``: the budget slicing, the orchestration (logs, summary, skip reasons,
a step killed at its slice, SIGTERM) with a stand-in interpreter, and the whole ``--dry-run`` (each
GPU-only check's CPU twin) with this venv's python. Every run is in its own process group with a
hard limit."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pace import scaled

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device_check.sh"


def _driver():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


dc = _driver()
NAMES = [s.name for s in dc.STEPS]


def run(args: list[str], limit: float, python: str = sys.executable) -> tuple[subprocess.CompletedProcess, float]:
    """``bash scripts/device_check.sh ARGS`` (the driver on ``python``) in a new process group,
    SIGKILLed with everything it started past ``limit`` seconds."""
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(SCRIPT), *args], env=dict(os.environ, PYTHON=python), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"device_check.sh {args} ran past {limit:.0f} s and was killed\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - t0


def gone(pid: int, within: float = 10.0) -> bool:
    """Whether process ``pid`` ended (a zombie not yet reaped by init counts) within ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


def summary(out: Path) -> dict:
    s = json.loads((out / "device_check.json").read_text())
    assert [o["name"] for o in s["steps"]] == NAMES  # every step listed, in order
    md = (out / "device_check.md").read_text()
    for name in NAMES:
        assert f"| {name} |" in md
    return s


# --------------------------------------------------------------------------- the budget


def test_a_step_gets_its_want_when_the_budget_holds_it() -> None:
    assert dc.plan_slice(400, 45, 20, [(75, 30), (None, 90)]) == 45


def test_no_step_takes_what_the_later_steps_need() -> None:
    # 100 s left, later steps need 30 + 60: this one gets 10 s, not its want of 45
    assert dc.plan_slice(100, 45, 10, [(75, 30), (None, 60)]) == 10
    # ... and below its own need it is skipped
    assert dc.plan_slice(100, 45, 20, [(75, 30), (None, 60)]) is None


def test_the_open_step_takes_what_the_later_wants_leave() -> None:
    assert dc.plan_slice(300, None, 90, [(75, 30), (45, 15)]) == 300 - 120
    # squeezed: at least its need while the later steps keep their needs
    assert dc.plan_slice(150, None, 90, [(75, 30), (45, 15)]) == 90
    assert dc.plan_slice(150, None, 120, [(75, 30), (45, 15)]) is None
    # last: everything left
    assert dc.plan_slice(222, None, 90, []) == 222


def test_the_default_plan_fits_ten_minutes_on_one_h100() -> None:
    """Every step's need fits the default budget; their wants add up to more (they are caps), and
    a run whose every fixed step hits its cap still leaves selftest its need."""
    needs = sum(s.need for s in dc.STEPS)
    assert needs <= dc.DEFAULT_BUDGET < 600  # a device command's limit is 10 minutes
    assert sum(s.dry_need for s in dc.STEPS) <= dc.DEFAULT_DRY_BUDGET
    remaining, spent = dc.DEFAULT_BUDGET, 0.0
    for i, s in enumerate(dc.STEPS):  # each fixed step uses its whole slice
        later = [(t.want, t.need) for t in dc.STEPS[i + 1:]]
        got = dc.plan_slice(remaining - spent, s.want, s.need, later)
        assert got is not None and got >= s.need, s.name
        spent += got
    assert spent <= dc.DEFAULT_BUDGET


def test_the_dry_run_gives_the_lm_twin_its_rows_time() -> None:
    """Issue 38: the dry run (CI's floor) runs the LM row's CPU twin. After the probe and nccl have used
    their share, the lm step's slice still leaves its rows what selftest's lm section asks for."""
    from paratrain.selftest.lm import LM_SECONDS

    steps = {s.name: s for s in dc.STEPS}
    order = [s.name for s in dc.STEPS]
    assert order.index("lm") <= 1, order  # near the front: nothing before it can eat its slice
    remaining = dc.DEFAULT_DRY_BUDGET - 10 - steps["nccl"].dry_need  # the probe's seconds and nccl's
    later = [(s.dry_want, s.dry_need) for s in dc.STEPS[order.index("lm") + 1:]]
    got = dc.plan_slice(remaining, steps["lm"].dry_want, steps["lm"].dry_need, later)
    assert got is not None and dc.inner_budget(got) >= LM_SECONDS["cpu"] + 5, got  # 5 s: selftest's own start


def test_inner_budget_leaves_time_to_report() -> None:
    assert dc.inner_budget(200) == 170
    assert dc.inner_budget(40) == 30
    assert dc.inner_budget(12) == 6


def test_a_dry_run_given_more_than_its_budget_kills_a_step_that_much_later_past_its_slice() -> None:
    # CI's floor gives the dry run 180 s times the machine's pace: a slower machine's step is not killed at the
    # quiet machine's slice; a GPU run's budget is device time, and its slices are its kill times
    assert dc.kill_room(2 * dc.DEFAULT_DRY_BUDGET, dry=True) == 2
    assert dc.kill_room(dc.DEFAULT_DRY_BUDGET / 2, dry=True) == 1
    assert dc.kill_room(2 * dc.DEFAULT_BUDGET, dry=False) == 1


# --------------------------------------------------------------------------- the orchestration


FAKE_PROBE = {"python": "3.12.0", "executable": "fake", "torch": "2.11.0+cu130", "cuda_build": "13.0", "cuda": False,
              "cores": 16, "gpus": [], "packages": {"matplotlib": True, "torchvision": False, "triton": True,
                                                     "accelerate": True, "lightning": True},
              "paratrain": "0.1.0", "paratrain_from": str(ROOT / "paratrain")}


def fake_python(tmp: Path, body: str) -> str:
    """An interpreter stand-in: answers the probe at once, runs ``body`` (bash) for any step."""
    path = tmp / "fakepython"
    path.write_text("#!/usr/bin/env bash\n"
                    f"if [ \"$1\" = -c ]; then echo 'PROBE {json.dumps(FAKE_PROBE)}'; exit 0; fi\n"
                    f"{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_skip_reasons_without_cuda_and_for_the_budget(tmp_path: Path) -> None:
    """Not a dry run on a machine without CUDA: the GPU-only checks are skipped as such, a step left
    out by --only says so, and a budget too small for a step's need skips it."""
    py = fake_python(tmp_path, "exit 0")
    out = tmp_path / "out"
    res, _ = run(["--python", py, "--out", str(out), "--budget", "20", "--only", "nccl,dataloader,selftest"], 60)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = summary(out)
    by = {o["name"]: o for o in s["steps"]}
    assert by["nccl"]["status"] == "skipped" and by["nccl"]["summary"].startswith("no CUDA")
    assert by["bench_quick"]["summary"] == "not in --only"
    assert by["dataloader"]["status"] == "skipped" and by["dataloader"]["summary"].startswith("budget:")
    assert by["selftest"]["status"] == "skipped" and "budget" in by["selftest"]["summary"]
    assert s["packages_missing"] == {"torchvision": dc.OPTIONAL["torchvision"]}


@pytest.mark.waits
def test_a_step_past_its_slice_is_killed_with_what_it_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    py = fake_python(tmp_path, f"sleep 300 & echo $! > {pidfile}; wait")
    out = tmp_path / "out"
    res, took = run(["--dry-run", "--python", py, "--out", str(out), "--budget", "12", "--only", "nccl"], 60)
    assert res.returncode == 1, res.stdout[-3000:]
    nccl = {o["name"]: o for o in summary(out)["steps"]}["nccl"]
    assert nccl["status"] == "failed" and "killed at the end of its" in nccl["summary"], nccl
    assert took < scaled(30)  # the 12 s budget, python's start-up on this machine
    assert (out / "logs" / "nccl.log").read_text().startswith("$ ")
    assert gone(int(pidfile.read_text()))  # the step's whole process group went with it


def test_sigterm_ends_the_run_with_a_summary(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    py = fake_python(tmp_path, f"sleep 300 & echo $! > {pidfile}; wait")
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", str(SCRIPT), "--dry-run", "--python", py, "--out", str(out), "--only", "syncbn"],
                            env=dict(os.environ, PYTHON=sys.executable), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        # the file exists once the shell opens it for `echo`, and holds the pid a moment later
        while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pidfile.read_text().strip()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 1
    s = summary(out)
    assert s["interrupted"] == "stopped by SIGTERM" and not s["ok"]
    assert {o["name"]: o for o in s["steps"]}["syncbn"]["summary"] == "stopped by SIGTERM"
    assert gone(int(pidfile.read_text()))


def test_an_interpreter_without_torch_fails_with_the_reason(tmp_path: Path) -> None:
    py = tmp_path / "nopython"
    py.write_text("#!/usr/bin/env bash\necho \"ModuleNotFoundError: No module named 'torch'\" >&2; exit 1\n")
    py.chmod(0o755)
    out = tmp_path / "out"
    res, _ = run(["--dry-run", "--python", str(py), "--out", str(out)], 60)
    assert res.returncode == 1
    s = summary(out)
    assert all(o["status"] == "skipped" and "No module named 'torch'" in o["summary"] for o in s["steps"])


# --------------------------------------------------------------------------- the dry run


TWINS = "nccl,fp16_scaler,compile"  # CPU twins of GPU-only checks: one of each kind (a collective, a precision,
# a compiler); CI's floor step (scripts/test.sh) runs every twin, and the rest of the dry run, on the oldest torch


@pytest.mark.timeout(280)
def test_dry_run(tmp_path: Path) -> None:
    """The dry run of GPU-only checks (their CPU twins) with this venv's python: each ok, logs and
    summary files written, the other steps listed as left out. The whole dry run, every twin,
    selftest, bench and predictor included, is CI's floor step (scripts/test.sh), on the oldest torch."""
    out = tmp_path / "dc"
    res, took = run(["--dry-run", "--python", sys.executable, "--out", str(out), "--only", TWINS], 240)
    s = summary(out)
    by = {o["name"]: o for o in s["steps"]}
    for name, o in by.items():
        assert o["status"] in ("ok", "skipped"), f"{name}: {o['status']}: {o['summary']}\n{res.stdout[-3000:]}"
        assert o["summary"], name
        if o["status"] == "ok":
            assert (out / "logs" / f"{name}.log").exists() and o["slice_s"] and o["seconds"] <= o["slice_s"] + 10
    assert res.returncode == 0 and s["ok"], res.stdout[-3000:]
    ran = {name for name, o in by.items() if o["status"] == "ok"}
    assert ran == set(TWINS.split(",")), by
    assert all(o["summary"] == "not in --only" for name, o in by.items() if name not in ran), by
    assert by["compile"]["details"]["backend"] == "aot_eager"
    assert s["seconds"] <= s["budget_s"] + 15 and took < scaled(240)


def test_the_driver_knows_selftests_sections() -> None:
    from paratrain.selftest.run import SECTIONS

    assert dc.SELFTEST_SECTIONS == SECTIONS


def test_the_flight_recorder_part_reads_gloos_dump_back_through_doctor() -> None:
    """The nccl step's Flight Recorder part (issue 36 item 6) as its CPU twin: a child process with
    Flight Recorder on writes gloo's dump after one all_reduce, and ``paratrain doctor`` reads it back
    with the child's line. (On a GPU the child also times out an nccl collective; see the docs' H200 run.)"""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from device_checks.flight import flight_recorder; "
            "print('RESULT ' + json.dumps(flight_recorder('cpu', 60)))")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts")], capture_output=True, text=True,
                         timeout=scaled(120), start_new_session=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    got = json.loads(line[len("RESULT "):])
    assert got["child_exit"] == 0 and got["on_demand"].startswith("doctor: the ranks agree"), got
    assert "flight_child.py:9" in res.stdout, res.stdout[-2000:]
