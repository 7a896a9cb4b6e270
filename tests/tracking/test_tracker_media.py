"""``pt.log_image``, ``pt.log_histogram``, ``pt.log_table`` and ``pt.tracker``: each value read back
from every backend's own files (TensorBoard's event file, the wandb offline run's ``.wandb`` file and
media, MLflow's SQLite store and artifacts, Comet's offline archive, csv's ``media.jsonl``), your own
tracker in ``log_to``, and only the main process writing at world size 2."""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import paratrain
from paratrain.tracking import NoTracker, Tracker, Trackers
from paratrain.tracking.media import image_array, png_bytes, table_of

pytestmark = pytest.mark.timeout(240)

# a 3 x 4 x 5 float image in [0, 1] (C x H x W, torch's order) and what every backend must hold: H x W x C uint8
IMAGE = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5) / 59
PIXELS = np.round(IMAGE.permute(1, 2, 0).numpy() * 255).astype(np.uint8)
GREY = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20  # H x W uint8
WEIGHTS = torch.linspace(-1, 1, 100)
COLUMNS, ROWS = ["digit", "predicted", "confidence"], [[3, 3, 0.75], [8, 5, 0.5]]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb and Comet offline and quiet; MLflow's default store (no tracking server from the environment)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name in ("COMET_API_KEY", "COMET_START_ONLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COMET_CONFIG", os.devnull)  # no ~/.comet.config key: offline


def _decode(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)))


def _backends() -> list[str]:
    import importlib.util

    return ["csv", *(n for n, p in [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow"),
                                     ("comet", "comet_ml")] if importlib.util.find_spec(p) is not None)]


def _wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows of a wandb run's ``.wandb`` file (a LevelDB-style log of protobuf records:
    a 7-byte header, then 32 KiB blocks of records, each with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, record = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        record = chunk if kind in (1, 2) else record + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            if parsed.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in parsed.history.item})
    return rows


def test_images_histograms_and_tables_read_back_from_every_backend(tmp_path: Path, offline: None) -> None:
    pytest.importorskip("PIL")
    backends = _backends()
    pt = paratrain.Parallel(strategy="single", log_to=backends, log_dir=str(tmp_path))
    try:
        pt.log({"loss": 0.5}, step=1)
        pt.log_image("digit", IMAGE, step=1)
        pt.log_image("grey", GREY, step=1)
        pt.log_histogram("weights", WEIGHTS, step=1)
        pt.log_table("predictions", columns=COLUMNS, data=ROWS, step=1)
        pt.log({"loss": 0.25}, step=2)  # wandb commits step 1's row
        natives = {name: pt.tracker(name, unwrap=True) for name in backends}
        assert natives["csv"] is None
        assert pt.tracker("csv").name == "csv"
        if "tensorboard" in natives:
            from torch.utils.tensorboard import SummaryWriter

            assert isinstance(natives["tensorboard"], SummaryWriter)
            natives["tensorboard"].add_scalar("native/x", 7.0, 3)  # the writer itself: read back below
        if "wandb" in natives:
            import wandb

            assert isinstance(natives["wandb"], wandb.Run) and natives["wandb"] is pt.tracker("wandb").run
        if "mlflow" in natives:
            from mlflow.tracking import MlflowClient

            assert isinstance(natives["mlflow"], MlflowClient)
            mlflow_run = pt.tracker("mlflow").run_id
            natives["mlflow"].set_tag(mlflow_run, "native", "yes")
            uri = pt.tracker("mlflow").tracking_uri
        if "comet" in natives:
            comet_key = natives["comet"].get_key()
            natives["comet"].log_other("native", "yes")
        with pytest.raises(ValueError, match=r"^tracker 'neptune' is not one this run logs to: csv"):
            pt.tracker("neptune")
    finally:
        pt.close()

    # csv: media.jsonl, the PNGs and the table's CSV
    lines = [json.loads(line) for line in (tmp_path / "media.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"], r["name"], r["type"]) for r in lines] == [
        (1, "train", "digit", "image"), (1, "train", "grey", "image"), (1, "train", "weights", "histogram"),
        (1, "train", "predictions", "table")]
    assert lines[0]["path"] == "media/train/digit/step-00000001.png"
    assert (_decode((tmp_path / lines[0]["path"]).read_bytes()) == PIXELS).all()
    assert (_decode((tmp_path / lines[1]["path"]).read_bytes()) == GREY).all()
    assert lines[2]["num"] == 100 and sum(lines[2]["counts"]) == 100 and len(lines[2]["bins"]) == 65
    assert lines[2]["min"] == -1.0 and lines[2]["max"] == 1.0
    with open(tmp_path / lines[3]["path"], newline="") as f:
        assert list(csv.reader(f)) == [COLUMNS, ["3", "3", "0.75"], ["8", "5", "0.5"]]

    if "tensorboard" in backends:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "histograms": 0,
                                                                              "tensors": 0, "scalars": 0}).Reload()
        (image,) = acc.Images("train/digit")
        assert image.step == 1 and (_decode(image.encoded_image_string) == PIXELS).all()
        grey = _decode(acc.Images("train/grey")[0].encoded_image_string)  # torch's add_image writes it as RGB
        assert all((grey[:, :, c] == GREY).all() for c in range(3))
        (histogram,) = acc.Histograms("train/weights")
        assert histogram.step == 1 and histogram.histogram_value.num == 100
        assert histogram.histogram_value.min == -1.0 and histogram.histogram_value.max == 1.0
        (text,) = acc.Tensors("train/predictions/text_summary")  # torch names a text summary so
        assert text.tensor_proto.string_val[0].decode().splitlines() == [
            "| digit | predicted | confidence |", "|---|---|---|", "| 3 | 3 | 0.75 |", "| 8 | 5 | 0.5 |"]
        assert [(s.step, s.value) for s in acc.Scalars("native/x")] == [(3, 7.0)]

    if "wandb" in backends:
        (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
        row = next(r for r in _wandb_history(run_dir) if "train/digit/path" in r)
        assert row["_step"] == 1 and row["train/digit/_type"] == "image-file"
        assert (_decode((run_dir / "files" / row["train/digit/path"]).read_bytes()) == PIXELS).all()
        assert (_decode((run_dir / "files" / row["train/grey/path"]).read_bytes()) == GREY).all()
        assert row["train/weights/_type"] == "histogram" and sum(row["train/weights/values"]) == 100
        assert row["train/weights/bins"][0] == -1.0 and row["train/weights/bins"][-1] == 1.0
        table = json.loads((run_dir / "files" / row["train/predictions/path"]).read_text())
        assert table["columns"] == COLUMNS and table["data"] == ROWS

    if "mlflow" in backends:
        from mlflow.tracking import MlflowClient

        assert uri == "sqlite:///" + str(tmp_path / "mlflow.db")  # the default store: SQLite, in the run folder
        assert not (tmp_path / "mlruns").exists()
        client = MlflowClient(uri)
        run = client.get_run(mlflow_run)
        assert run.info.status == "FINISHED" and run.data.tags["native"] == "yes"
        assert run.info.artifact_uri == (tmp_path / "mlartifacts").as_uri() + f"/{mlflow_run}/artifacts"
        artifacts = tmp_path / "mlartifacts" / mlflow_run / "artifacts"
        (png,) = artifacts.glob("images/train~digit+step+1+*[0-9a-f].png")  # log_image's key and step
        assert (_decode(png.read_bytes()) == PIXELS).all()
        assert [a.path for a in client.list_artifacts(mlflow_run)] == ["histograms", "images", "tables"]
        histogram = json.loads((artifacts / "histograms/train/weights/step-00000001.json").read_text())
        assert histogram["num"] == 100 and sum(histogram["counts"]) == 100
        table = json.loads((artifacts / "tables/train/predictions/step-00000001.json").read_text())
        assert table["columns"] == COLUMNS and table["data"] == ROWS

    if "comet" in backends:
        (archive,) = (tmp_path / "comet").glob("*.zip")
        assert archive.name == f"{comet_key}.zip"
        with zipfile.ZipFile(archive) as z:
            messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines()]
            uploads = {}
            for m in messages:
                params = m["payload"].get("additional_params") or {} if m["type"] == "file_upload" else {}
                if params.get("fileName") or params.get("figName"):
                    uploads[params.get("fileName") or params.get("figName")] = m["payload"]
            image = uploads["train/digit"]
            assert image["upload_type"] == "visualization" and image["additional_params"]["step"] == 1
            assert (_decode(z.read(image["file_path"])) == PIXELS).all()
            histogram = uploads["train/weights"]
            assert histogram["upload_type"] == "histogram3d" and histogram["additional_params"]["step"] == 1
            table = uploads["train/predictions/step-00000001.csv"]
            assert z.read(table["file_path"]).decode().splitlines() == [
                "digit,predicted,confidence", "3,3,0.75", "8,5,0.5"]
        metrics = [m["payload"]["metric"] for m in messages if m["type"] == "metric_msg"]
        assert [(m["step"], m["metricValue"]) for m in metrics if m["metricName"] == "train/loss"] == [(1, 0.5), (2, 0.25)]
        others = {m["payload"]["key"]: m["payload"]["value"] for m in messages if m["type"] == "log_other"}
        assert others["native"] == "yes"


class Recorder(Tracker):
    """A user's own backend: only metrics and images (histograms and tables: not defined)."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.images: list[tuple[str, np.ndarray, int, str]] = []
        self.metrics: list[tuple[dict, int, str]] = []

    def log_metrics(self, metrics, step, kind):
        self.metrics.append((dict(metrics), step, kind))

    def log_image(self, name, image, step, kind):
        self.images.append((name, image, step, kind))

    @property
    def experiment(self):
        return self.images


def test_your_own_tracker_in_log_to_and_a_missing_kind_is_one_warning(tmp_path: Path) -> None:
    recorder = Recorder()
    pt = paratrain.Parallel(strategy="single", log_to=["csv", recorder], log_dir=str(tmp_path))
    try:
        pt.global_step = 4
        pt.log({"loss": 1.0})
        pt.log_image("sample", IMAGE)
        assert pt.tracker("recorder") is recorder and pt.tracker("recorder", unwrap=True) is recorder.images
        with pytest.warns(UserWarning) as caught:
            pt.log_histogram("weights", WEIGHTS)
            pt.log_histogram("weights", WEIGHTS, step=5)  # once per kind
            pt.log_table("t", columns=["a"], data=[[1]])
        messages = [str(w.message) for w in caught]
        assert messages == [
            "tracker 'recorder' (Recorder) takes no histograms: pt.log_histogram records them in the other "
            "trackers only (define log_histogram on it)",
            "tracker 'recorder' (Recorder) takes no tables: pt.log_table records them in the other trackers only "
            "(define log_table on it)"]
        assert caught[0].filename == __file__  # points at the user's call
    finally:
        pt.close()
    assert recorder.metrics == [({"loss": 1.0}, 4, "train")]
    ((name, image, step, kind),) = recorder.images
    assert (name, step, kind) == ("sample", 4, "train") and image.dtype == np.uint8 and (image == PIXELS).all()
    assert recorder.log_dir == str(tmp_path) and recorder.run_name == tmp_path.name
    assert [json.loads(line)["type"] for line in (tmp_path / "media.jsonl").read_text().splitlines()] == [
        "image", "histogram", "histogram", "table"]  # csv took all of them


def test_what_the_media_calls_accept_and_their_one_line_errors(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    from PIL import Image

    assert (image_array(IMAGE) == PIXELS).all()
    assert (image_array(PIXELS) == PIXELS).all()  # an array is H x W x C already
    assert (image_array(IMAGE.to(torch.bfloat16)).astype(int) - PIXELS.astype(int)).__abs__().max() <= 2
    assert image_array(torch.tensor([[True, False]])).tolist() == [[[255], [0]]]
    assert image_array(np.array([[-0.5, 2.0, float("nan")]])).ravel().tolist() == [0, 255, 0]  # clipped
    palette = Image.fromarray(PIXELS).convert("P")
    assert image_array(palette).shape == (4, 5, 3)
    assert (_decode(png_bytes(image_array(Image.fromarray(PIXELS, "RGB")))) == PIXELS).all()
    rgba = np.dstack([PIXELS, np.full((4, 5), 128, np.uint8)])
    assert (_decode(png_bytes(rgba)) == rgba).all()

    assert table_of(data={"a": [1, 2], "b": ["x", "y"]}) == (["a", "b"], [[1, "x"], [2, "y"]])
    assert table_of(["a"], [[torch.tensor(0.5)], [np.int64(3)]]) == (["a"], [[0.5], [3]])
    pandas = pytest.importorskip("pandas")
    assert table_of(dataframe=pandas.DataFrame({"a": [1], "b": [2.5]})) == (["a", "b"], [[1.0, 2.5]])

    pt = paratrain.Parallel(strategy="single")  # no trackers: still checked, as on every rank
    try:
        for call, message in [
            (lambda: pt.log_image("x", torch.zeros(2, 4, 4)), r"^log_image: an image of shape \(2, 4, 4\) is neither "
                                                                r"H x W nor C x H x W with 1, 3 or 4 channels"),
            (lambda: pt.log_image("x", np.zeros((4, 4, 5))), r"H x W x C with 1, 3 or 4 channels \(an array is"),
            (lambda: pt.log_image("x", np.zeros((0, 4))), r"^log_image: the image is empty"),
            (lambda: pt.log_table("t", data=[[1, 2]]), r"^log_table: pass columns= with the rows of data="),
            (lambda: pt.log_table("t", columns=["a", "b"], data=[[1]]), r"^log_table: row 0 has 1 values for 2 "
                                                                        r"columns \(a, b\)$"),
            (lambda: pt.log_table("t", columns=["a"]), r"^log_table: pass data="),
            (lambda: pt.tracker("wandb"), r"^tracker 'wandb' is not one this run logs to: none \(log_to is empty\)$"),
        ]:
            with pytest.raises(ValueError, match=message) as e:
                call()
            assert "\n" not in str(e.value)
    finally:
        pt.close()
    assert not list(tmp_path.iterdir())


def test_no_tracker_does_nothing_whatever_is_done_with_it() -> None:
    off = Trackers("csv", enabled=False).get("csv", unwrap=True)
    assert isinstance(off, NoTracker) and not off
    off.log({"a": 1}, step=2).finish()
    off.config["lr"] = 0.1
    off.summary.update({"x": 1})
    off.name = "x"
    assert off.name is off and off["lr"] is off and list(off) == []
    with off as inner:
        assert inner is off


def _world2_worker(rank: int, folder: str, backends: list[str]) -> dict[str, Any]:
    """Each rank logs media into its own folder and asks for the backends' objects: rank 0 only writes."""
    mine = os.path.join(folder, f"rank{rank}")
    pt = paratrain.Parallel(strategy="ddp", backend="gloo", global_batch=2, log_to=backends, log_dir=mine)
    try:
        pt.log_image("digit", IMAGE, step=1)
        pt.log_histogram("weights", WEIGHTS * (rank + 1), step=1)
        pt.log_table("predictions", columns=COLUMNS, data=ROWS, step=1)
        natives = {name: pt.tracker(name, unwrap=True) for name in backends}
        if "tensorboard" in natives:
            natives["tensorboard"].add_scalar("native/rank", float(rank), 1)  # a no-op on rank 1
        try:
            pt.tracker("neptune")
            unknown = ""
        except ValueError as e:
            unknown = str(e)
        types = {name: type(native).__name__ for name, native in natives.items()}
        truthy = {name: bool(native) for name, native in natives.items() if name != "csv"}
    finally:
        pt.close()
    return {"types": types, "truthy": truthy, "unknown": unknown,
            "files": sorted(os.listdir(mine)) if os.path.isdir(mine) else []}


def test_only_the_main_process_writes_media_and_gets_the_backends_at_world_size_2(tmp_path: Path, offline: None) -> None:
    backends = [b for b in _backends() if b != "comet"]  # comet is read back above; it adds 10 s here
    ranks = paratrain.launch(_world2_worker, nprocs=2, args=(str(tmp_path), backends), timeout=200,
                             env={"OMP_NUM_THREADS": "1"})
    assert ranks[1]["files"] == [] and sorted(p.name for p in tmp_path.iterdir()) == ["rank0"]
    assert set(ranks[1]["types"].values()) == {"NoTracker"} and not any(ranks[1]["truthy"].values())
    assert all(ranks[0]["truthy"].values())
    expected = {"csv": "NoneType", "tensorboard": "SummaryWriter", "wandb": "Run", "mlflow": "MlflowClient"}
    assert ranks[0]["types"] == {b: expected[b] for b in backends}
    assert ranks[0]["unknown"] == ranks[1]["unknown"] == (
        f"tracker 'neptune' is not one this run logs to: {', '.join(backends)}")
    lines = [json.loads(line) for line in (tmp_path / "rank0" / "media.jsonl").read_text().splitlines()]
    assert [r["type"] for r in lines] == ["image", "histogram", "table"] and lines[1]["max"] == 1.0  # rank 0's
    if "tensorboard" in backends:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(glob.glob(str(tmp_path / "rank0" / "tensorboard"))[0]).Reload()
        assert [(s.step, s.value) for s in acc.Scalars("native/rank")] == [(1, 0.0)]
        assert acc.Tags()["images"] == ["train/digit"]
    if "mlflow" in backends:
        assert "mlflow.db" in ranks[0]["files"] and "mlartifacts" in ranks[0]["files"]


def test_a_resumed_run_drops_the_media_lines_logged_after_its_checkpoint(tmp_path: Path) -> None:
    first = Trackers("csv", str(tmp_path))
    for step in (1, 2, 3):
        first.log_histogram("weights", [step], step)
    first.close()
    resumed = Trackers("csv", str(tmp_path))
    resumed.resume_at(1)  # the checkpoint was at step 1: steps 2 and 3 come again
    resumed.log_histogram("weights", [2.0], 2)
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "media.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sum"]) for r in lines] == [(1, 1.0), (2, 2.0)]
    fresh = Trackers("csv", str(tmp_path))  # not resumed: a new media.jsonl, as train.csv
    fresh.log_histogram("weights", [5.0], 1)
    assert [json.loads(line)["sum"] for line in (tmp_path / "media.jsonl").read_text().splitlines()] == [5.0]
