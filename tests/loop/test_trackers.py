"""``pt.log`` and the trackers (csv, tensorboard, wandb, mlflow, comet): what each backend receives,
the one-line errors for a bad ``log_to``, MLflow's store, and that only rank 0 opens a backend's run.
Images, histograms, tables and ``pt.tracker``: tests/tracking/test_tracker_media.py."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.tracking import CSVTracker, Trackers, parse_log_to

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb and Comet offline and quiet; MLflow's default local store (no tracking server from the environment)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name in ("COMET_API_KEY", "COMET_START_ONLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COMET_CONFIG", os.devnull)  # no ~/.comet.config key: offline


def test_a_bad_log_to_is_one_line_naming_the_value_and_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"^log_to 'neptune' is unknown: use csv, tensorboard, wandb, mlflow, comet "
                                         r"\(comma-separated\)$") as e:
        parse_log_to("csv,neptune")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="log_to 'nope' is unknown"):
        paratrain.TrainConfig(log_to=["nope"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError) as e:
        paratrain.TrainConfig.load(None, {"log_to": "csv,wandb"})  # as --log-to csv,wandb gives it
    assert str(e.value) == ("log_to 'wandb' needs the wandb package: pip install wandb (or pip install "
                            "'paratrain[trackers]'), or drop 'wandb' from log_to")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "comet_ml" else real(name, *a))
    with pytest.raises(ValueError, match=r"^log_to 'comet' needs the comet_ml package: pip install comet-ml, or drop"):
        parse_log_to("comet")
    assert parse_log_to(" CSV, tensorboard,csv ") == ["csv", "tensorboard"]
    assert paratrain.TrainConfig(tensorboard=True).log_to == ["csv", "tensorboard"]  # --tensorboard: an alias


def test_pt_log_writes_to_every_backend_with_the_run_config(tmp_path: Path, offline: None) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pt = paratrain.Parallel(strategy="single", log_to=["csv", "tensorboard", "wandb", "mlflow"], log_dir=str(tmp_path))
    try:
        pt.log({"loss": 0.5, "acc": torch.tensor(0.75)}, step=1)
        pt.global_step = 2
        pt.log({"loss": 0.25, "acc": 1.0})  # step: the optimizer steps taken
        pt.log({"accuracy": 0.9}, step=2, kind="eval")
        wandb_run = next(t for t in pt.trackers.open() if t.name == "wandb").run
        # wandb commits a step's row (train and eval at step 2 are one row) once a later step arrives
        assert wandb_run.summary["train/loss"] == 0.5 and wandb_run.summary["train/acc"] == 0.75
        assert wandb_run.config["parallel"]["strategy"] == "single"
        assert wandb_run.config["provenance"]["torch"] == torch.__version__
        mlflow_tracker = next(t for t in pt.trackers.open() if t.name == "mlflow")
        run_id, uri = mlflow_tracker.run_id, mlflow_tracker.tracking_uri
    finally:
        pt.close()
    assert (tmp_path / "train.csv").read_text().splitlines() == ["step,loss,acc", "1,0.5,0.75", "2,0.25,1.0"]
    assert [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()] == [
        {"step": 2, "accuracy": 0.9}]
    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 0.5), (2, 0.25)]
    assert uri == "sqlite:///" + str(tmp_path / "mlflow.db")  # the default store: SQLite in the run folder
    client = MlflowClient(uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/acc")] == [(1, 0.75), (2, 1.0)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert run.data.params["parallel.strategy"] == "single"
    assert run.data.params["provenance.paratrain"] == paratrain.__version__
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1


def test_without_trackers_pt_log_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    pt = paratrain.Parallel(strategy="single")
    pt.log({"loss": 1.0})
    pt.close()
    assert list(tmp_path.iterdir()) == []


def test_log_to_without_log_dir_starts_a_new_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    firsts = []
    for _ in range(2):
        trackers = Trackers("csv")
        trackers.log({"loss": 1.0}, step=1)
        firsts.append(trackers.log_dir)
    assert firsts[0] != firsts[1]  # two runs in one second: two folders
    assert os.path.realpath(tmp_path / "runs" / "latest") == os.path.realpath(firsts[1])
    assert all((Path(d) / "train.csv").is_file() for d in firsts)


def _world2_worker(rank: int, folder: str) -> list[str]:
    """Every rank asks for the same backends in its own folder and logs: only rank 0's may fill up."""
    mine = os.path.join(folder, f"rank{rank}")
    pt = paratrain.Parallel(strategy="ddp", backend="gloo", global_batch=2, log_to="csv,tensorboard,wandb,mlflow",
                            log_dir=mine, loggers=[CSVTracker(os.path.join(folder, f"instance{rank}"))])
    pt.log({"loss": float(rank)}, step=1)
    pt.close()
    return sorted(os.listdir(mine)) if os.path.isdir(mine) else []


def test_only_rank_0_creates_runs_at_world_size_2(tmp_path: Path, offline: None) -> None:
    """Lightning#17885: a wandb/MLflow run per rank. Here ranks other than 0 open nothing."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    listed = paratrain.launch(_world2_worker, nprocs=2, args=(str(tmp_path),), timeout=150,
                              env={"OMP_NUM_THREADS": "1"})
    assert listed[0] == ["mlflow.db", "tensorboard", "trackers.json", "train.csv", "train.jsonl", "wandb"] and listed[1] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["instance0", "rank0"]
    assert (tmp_path / "rank0" / "train.csv").read_text().splitlines() == ["step,loss", "1,0.0"]
    assert len(list((tmp_path / "rank0" / "wandb").glob("offline-run-*"))) == 1
    from mlflow.tracking import MlflowClient

    client = MlflowClient("sqlite:///" + str(tmp_path / "rank0" / "mlflow.db"))
    experiments = client.search_experiments()
    assert len(client.search_runs([e.experiment_id for e in experiments])) == 1  # one run in one experiment


def test_a_resumed_run_continues_its_wandb_and_mlflow_runs(tmp_path: Path, offline: None) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    def session(append: bool, config: dict, step: int) -> tuple[str, str, str]:
        trackers = Trackers(["wandb", "mlflow"], str(tmp_path), append=append, config=config)
        try:
            trackers.log({"loss": 1.0 / step}, step=step)
            wandb_t, mlflow_t = trackers.open()
            return wandb_t.run.id, mlflow_t.run_id, mlflow_t.tracking_uri
        finally:
            trackers.close()

    wandb_id, run_id, uri = session(False, {"lr": 0.1}, 1)
    # resumed (what the train loop passes after --resume): the same runs; a changed param is kept as first
    # logged (MLflow refuses changes), a new one is added
    assert session(True, {"lr": 0.2, "resume": True}, 2) == (wandb_id, run_id, uri)
    client = MlflowClient(uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(1, 1.0), (2, 0.5)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1", "resume": "True"}
    fresh_wandb, fresh_run, _ = session(False, {"lr": 0.1}, 1)  # not resumed: new runs
    assert fresh_wandb != wandb_id and fresh_run != run_id


def test_a_resumed_run_continues_its_comet_experiment(tmp_path: Path, offline: None) -> None:
    pytest.importorskip("comet_ml")
    import zipfile

    def session(append: bool, step: int) -> str:
        trackers = Trackers("comet", str(tmp_path), append=append, config={"lr": 0.1})
        try:
            trackers.log({"loss": 1.0 / step}, step=step)
            return trackers.get("comet", unwrap=True).get_key()
        finally:
            trackers.close()

    key = session(False, 1)
    assert session(True, 2) == key  # offline: a second archive of the same experiment (comet upload sends both)
    archives = sorted((tmp_path / "comet").glob(f"{key}*.zip"))
    assert len(archives) == 2
    steps = []
    for archive in archives:
        with zipfile.ZipFile(archive) as z:
            assert json.loads(z.read("experiment.json"))["offline_id"] == key
            steps += [json.loads(line)["payload"]["metric"]["step"] for line in z.read("messages.json").splitlines()
                      if json.loads(line)["type"] == "metric_msg"
                      and json.loads(line)["payload"]["metric"]["metricName"] == "train/loss"]
    assert sorted(steps) == [1, 2]
    assert session(False, 1) != key  # not resumed: a new experiment


def test_mlflow_store_env_uri_and_the_file_store_fallbacks(tmp_path: Path, offline: None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The default is SQLite (the other tests); MLFLOW_TRACKING_URI wins; without sqlalchemy, or for a
    run an older paratrain started in <log_dir>/mlruns, the file store (fast: no database to create)."""
    pytest.importorskip("mlflow")
    from paratrain.tracking import MLflowTracker

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when asked to
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:" + str(tmp_path / "elsewhere"))  # a server's URL: the same
    tracker = MLflowTracker(str(tmp_path / "a"), "a")
    tracker.log_metrics({"loss": 1.0}, 1, "train")
    tracker.close()
    assert tracker.tracking_uri == "file:" + str(tmp_path / "elsewhere") and (tmp_path / "elsewhere").is_dir()
    assert not (tmp_path / "a" / "mlflow.db").exists()

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    tracker = MLflowTracker(str(tmp_path / "b"), "b")
    with pytest.warns(UserWarning, match="^mlflow: without sqlalchemy and alembic the run goes to MLflow's deprecated "
                                         "file store .*: pip install sqlalchemy alembic"):
        tracker.log_metrics({"loss": 1.0}, 1, "train")
    run_id = tracker.run_id
    tracker.close()
    assert tracker.tracking_uri == "file:" + str(tmp_path / "b" / "mlruns")

    monkeypatch.setattr(importlib.util, "find_spec", real)  # sqlalchemy back: a resumed file-store run stays there
    tracker = MLflowTracker(str(tmp_path / "b"), "b")
    tracker.append, tracker.resume_step = True, 1
    tracker.log_metrics({"loss": 0.5}, 2, "train")
    assert tracker.run_id == run_id and tracker.tracking_uri == "file:" + str(tmp_path / "b" / "mlruns")
    tracker.close()
    assert not (tmp_path / "b" / "mlflow.db").exists()


def test_trackers_are_finished_at_exit_without_pt_close(tmp_path):
    """A loop that never calls pt.close() left its MLflow run RUNNING, its wandb run unfinished."""
    import subprocess
    import sys
    import textwrap

    from clitools import cli_env

    script = textwrap.dedent(f"""
        import paratrain
        from paratrain.tracking import Tracker

        class Recorder(Tracker):
            def log_metrics(self, metrics, step, kind):
                pass

            def close(self, ok=True):
                open({str(tmp_path / "closed")!r}, "a").write(f"ok={{ok}}\\n")

        pt = paratrain.Parallel(global_batch=4, loggers=[Recorder()], log_dir={str(tmp_path / "run")!r})
        pt.log({{"loss": 1.0}}, step=1)
        import sys
        if len(sys.argv) > 1:
            raise RuntimeError("the loop failed")
    """)
    (tmp_path / "loop.py").write_text(script)
    assert subprocess.run([sys.executable, str(tmp_path / "loop.py")], env=cli_env(), timeout=120).returncode == 0
    subprocess.run([sys.executable, str(tmp_path / "loop.py"), "fail"], env=cli_env(), capture_output=True, timeout=120)
    assert (tmp_path / "closed").read_text().splitlines() == ["ok=True", "ok=False"]


def test_a_key_that_first_appears_later_is_reported_once(tmp_path):
    from paratrain.tracking import CSVTracker

    tracker = CSVTracker(str(tmp_path))
    tracker.log_metrics({"loss": 1.0}, 1, "train")
    with pytest.warns(UserWarning, match="train.csv keeps the columns of its first record: grad_norm go to train.jsonl"):
        tracker.log_metrics({"loss": 1.0, "grad_norm": 2.0}, 2, "train")
    tracker.log_metrics({"loss": 1.0, "grad_norm": 2.0}, 3, "train")  # once
    assert (tmp_path / "train.jsonl").read_text().count("grad_norm") == 2


def test_a_tracker_without_log_metrics_cannot_be_made():
    from paratrain.tracking import Tracker

    class Half(Tracker):
        name = "half"

    with pytest.raises(TypeError, match="log_metrics"):
        Half()
