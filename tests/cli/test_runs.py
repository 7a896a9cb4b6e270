"""Run folders: ``runs/<name or start time>``, ``runs/latest``, and ``--resume`` of the latest run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from clitools import run_cli
from paratrain.cli import train as train_cli

pytestmark = pytest.mark.timeout(200)

TRAIN = ["train", "--max-steps", "2", "--checkpoint-every", "2", "--no-progress"]


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, dict[str, tuple[bytes, int]]]:
    """``paratrain train`` twice in one folder: once unnamed, once ``--name second`` with MLflow;
    returns the folder, both runs, and the first run's files as they were before the second."""
    cwd = tmp_path_factory.mktemp("cwd")
    env = {"MLFLOW_TRACKING_URI": ""}  # MLflow's default: the run folder's mlflow.db
    first = run_cli(TRAIN, timeout=90, cwd=cwd, **env)
    assert first.returncode == 0, first.stderr[-3000:]
    (stamp,) = [p for p in (cwd / "runs").iterdir() if p.name != "latest"]
    before = _files(stamp)
    log_to = "csv,mlflow" if _installed("mlflow") else "csv"
    second = run_cli([*TRAIN, "--name", "second", "--log-to", log_to], timeout=90, cwd=cwd, **env)
    assert second.returncode == 0, second.stderr[-3000:]
    return cwd, stamp, cwd / "runs" / "second", before


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_runs_do_not_overwrite_each_other(two_runs: tuple[Path, Path, Path, dict]) -> None:
    cwd, stamp, second, before = two_runs
    assert len(stamp.name) == len("20250101-120000") and stamp.name[8] == "-"
    assert sorted(p.name for p in (cwd / "runs").iterdir()) == sorted([stamp.name, "second", "latest"])
    assert os.readlink(cwd / "runs" / "latest") == "second"  # relative: the runs folder can move
    assert _files(stamp) == before  # the first run untouched by the second
    for run in (stamp, second):
        assert {"config.toml", "train.csv", "train.jsonl", "eval.csv", "result.json"} <= {p.name for p in run.iterdir()}
        assert (run / "checkpoints").is_dir()


def test_tracker_run_gets_the_config_and_provenance(two_runs: tuple[Path, Path, Path, dict],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when asked to
    import json

    from mlflow.tracking import MlflowClient

    second = two_runs[2]
    uri = json.loads((second / "trackers.json").read_text())["mlflow"]["tracking_uri"]
    assert uri == "sqlite:///" + str(second.resolve() / "mlflow.db")  # paratrain's default store
    client = MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    provenance = json.loads((second / "result.json").read_text())["provenance"]
    assert run.info.run_name == "second" and run.info.status == "FINISHED"
    assert run.data.params["model"] == "mlp" and run.data.params["name"] == "second"
    assert run.data.params["provenance.torch"] == provenance["torch"]
    assert run.data.params["provenance.command"] == provenance["command"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2]


def test_resume_of_the_finished_latest_run_changes_nothing(two_runs: tuple[Path, Path, Path, dict]) -> None:
    cwd, _, second, _ = two_runs
    before = _files(cwd / "runs")
    result = (second / "result.json").read_bytes()
    again = run_cli([*TRAIN, "--resume"], timeout=90, cwd=cwd, MLFLOW_TRACKING_URI="")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines() == [
        "paratrain: this run already finished at step 2; runs/second/result.json is kept as it is "
        "(raise --epochs or --max-steps to train on)"]
    assert (second / "result.json").read_bytes() == result
    assert _files(cwd / "runs") == before  # not one byte or timestamp of any run changed, no new run
    assert os.readlink(cwd / "runs" / "latest") == "second"


# --- choosing the folder (in-process: no training) ---------------------------------------------

def _config(*argv: str) -> object:
    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", *argv])
    return train_cli.build_config(args)


def test_resume_without_runs_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        train_cli._pick_run(_config("--resume"), worker=False)  # type: ignore[arg-type]
    assert str(e.value) == ("--resume: there is no run in runs/ to resume (runs/latest does not exist): give the "
                            "run's folder, --resume runs/<name>")
    assert not (tmp_path / "runs").exists()


def test_explicit_folders_and_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = train_cli._pick_run(_config("--log-dir", "mine"), worker=False)  # type: ignore[arg-type]
    assert cfg.log_dir == "mine" and not (tmp_path / "runs").exists()  # --log-dir: exactly there, as before
    cfg = train_cli._pick_run(_config("--resume", "old/run7"), worker=False)  # type: ignore[arg-type]
    assert (cfg.log_dir, cfg.checkpoint_dir, cfg.resume) == ("old/run7", "old/run7/checkpoints", True)
    with pytest.raises(ValueError, match="^--resume 'a' and --log-dir 'b' name two runs: give one$"):
        _config("--resume", "a", "--log-dir", "b")
    cfg = train_cli._pick_run(_config("--name", "exp1", "--checkpoint-every", "5"), worker=False)  # type: ignore[arg-type]
    assert (cfg.log_dir, cfg.checkpoint_dir) == ("runs/exp1", "runs/exp1/checkpoints")
    assert os.readlink(tmp_path / "runs" / "latest") == "exp1"
    cfg = train_cli._pick_run(_config("--resume"), worker=False)  # type: ignore[arg-type]
    assert cfg.log_dir == "runs/exp1" and os.readlink(tmp_path / "runs" / "latest") == "exp1"
    with pytest.raises(ValueError, match="cannot be a run folder's name"):
        _config("--name", "a/b")


def test_a_latest_folder_of_an_older_paratrain_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "latest").mkdir(parents=True)
    with pytest.warns(UserWarning, match="is a folder .* not a link"):
        cfg = train_cli._pick_run(_config(), worker=False)  # type: ignore[arg-type]
    assert cfg.log_dir != "runs/latest" and Path(cfg.log_dir).is_dir()  # type: ignore[attr-defined]
    assert (tmp_path / "runs" / "latest").is_dir() and not (tmp_path / "runs" / "latest").is_symlink()


def test_a_named_run_is_not_written_over_and_config_toml_reruns_as_a_new_run(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = train_cli._pick_run(_config("--name", "exp1", "--checkpoint-every", "5"), worker=False)  # type: ignore[arg-type]
    (tmp_path / "runs" / "exp1" / "result.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^run folder 'runs/exp1' already holds a run: continue it with --resume "
                                         r"runs/exp1, or choose another --name$"):
        train_cli._pick_run(_config("--name", "exp1"), worker=False)  # type: ignore[arg-type]
    again = cfg.as_new_run()  # what the run folder's config.toml holds
    assert (again.name, again.log_dir, again.checkpoint_dir) == (None, "runs/{name}", "runs/{name}/checkpoints")
    mine = train_cli._pick_run(_config("--name", "exp2", "--log-dir", "mine"), worker=False)  # type: ignore[arg-type]
    assert mine.as_new_run().log_dir == "mine"  # a folder given outright stays


def test_a_folder_given_outright_is_not_written_over_and_a_failed_start_is_reusable(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train.csv").write_text("step,loss\n")
    with pytest.raises(ValueError, match=r"^log_dir 'out' already holds a run: continue it with --resume out, or "
                                         r"choose another --log-dir$"):
        train_cli._pick_run(_config("--log-dir", "out"), worker=False)  # type: ignore[arg-type]
    assert train_cli._pick_run(_config("--log-dir", "out", "--resume"), worker=False).log_dir == "out"  # type: ignore[arg-type]
    # a run that failed before it started left only its traceback: the folder is free
    (tmp_path / "runs" / "ghost").mkdir(parents=True)
    (tmp_path / "runs" / "ghost" / "error-train-rank0.log").write_text("Traceback ...")
    assert train_cli._pick_run(_config("--name", "ghost"), worker=False).log_dir == "runs/ghost"  # type: ignore[arg-type]
    # the config.toml of a resumed run re-runs the job as a new run
    assert not _config("--resume", "out").as_new_run().resume


def test_the_logged_lr_is_the_one_the_step_used(tmp_path: Path) -> None:
    import csv

    from paratrain.config import TrainConfig
    from paratrain.loop.train import run_training

    cfg = TrainConfig.load(None, {"model": "mlp", "max_steps": 3, "log_every": 1, "optim.warmup_steps": 2,
                                  "optim.lr": 0.1, "log_dir": str(tmp_path)})
    run_training(cfg)
    with open(tmp_path / "train.csv", newline="") as f:
        lrs = [float(row["lr"]) for row in csv.DictReader(f)]
    assert lrs == pytest.approx([0.05, 0.1, 0.1])  # linear warmup over 2 steps: step 1 used half the lr


def test_folder_settings_that_cannot_work_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from paratrain.config import TrainConfig
    from paratrain.tracking import runs

    with pytest.raises(ValueError, match="^checkpoint_every 5 needs a checkpoint_dir"):
        TrainConfig.load(None, {"checkpoint_every": 5, "log_dir": None})
    with pytest.raises(ValueError, match="^log_dir is empty: give a folder"):
        TrainConfig.load(None, {"log_dir": ""})
    with pytest.raises(ValueError, match=r"^log_dir 'runs/exp-\{name\}': \{name\} must be a whole folder"):
        TrainConfig.load(None, {"log_dir": "runs/exp-{name}"})

    def no_links(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", no_links)  # a filesystem without symbolic links
    with pytest.warns(UserWarning, match="no symbolic links on this filesystem"):
        made = runs.new_run_dir(str(tmp_path / "runs"))
    assert os.path.isdir(made)


def test_ctrl_c_is_one_line(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    from clitools import cli_env

    proc = subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--epochs", "100000", "--no-progress",
                             "--log-dir", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cli_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("paratrain: single on 1 process")
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.strip().splitlines() == ["paratrain train: interrupted (a run continues from its last checkpoint with "
                                        "--resume)"], err


def test_workers_without_a_shared_job_id_need_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain torchrun (rdzv id "none"): each worker once named the run folder by its own clock."""
    monkeypatch.chdir(tmp_path)
    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", TORCHELASTIC_RUN_ID="none").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="share no job id to name the run folder after .* pass --name NAME"):
        train_cli._pick_run(_config(), worker=True)  # type: ignore[arg-type]
    assert train_cli._pick_run(_config("--name", "exp"), worker=True).log_dir == "runs/exp"  # type: ignore[arg-type]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert train_cli._pick_run(_config(), worker=True).log_dir == "runs/job7"  # type: ignore[arg-type]
