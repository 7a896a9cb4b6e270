"""``paratrain bench``: the matrix, the table, JSON/CSV/PNG output, on a tiny matrix (CPU, 2 cores)."""

import csv
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

import paratrain
from clitools import run_cli
from paratrain.bench import BenchSpec, build_matrix, format_table, quick_spec
from paratrain.bench.matrix import Cell
from paratrain.bench.report import write_all
from paratrain.bench.runner import BenchResult, CellResult, recommend
from paratrain.config import TrainConfig

NO_GPU = not torch.cuda.is_available()
MLP_DIGITS_GRAD_BYTES = 4 * (64 * 512 + 512 + 512 * 10 + 10)  # seed 003's MLP on 8x8 digits, fp32


def test_quick_matrix_lists_every_cell_and_why_some_cannot_run():
    cells = build_matrix(quick_spec(), TrainConfig(), train_size=1438)
    labels = [c.label for c in cells]
    assert labels[0] == "single"
    assert {"ddp x2", "ddp x2 bf16-mixed", "ddp x2 hook=fp16", "ddp x2 hook=powersgd", "fsdp x2",
            "plain DDP (hand-written) x2", "ddp x2 batch 64", "ddp x2 batch 128"} <= set(labels)
    assert any(label.startswith("ddp x2 batch 128 lr x2 + warmup") for label in labels)
    if NO_GPU:
        skipped = {c.label: c.skip for c in cells if c.skip}
        assert "GPUs" in skipped["dp x2"] and "nccl" in skipped["ddp x2 nccl"]
    assert [c.group for c in cells].count("trap") == 3
    # the trap's "global batch kept" cell trains as the matrix's ddp x2 (run once), with the job's
    # own lr rule; the grown ones set theirs, whatever the job's (--base-batch/--warmup-steps)
    by = {c.label: c for c in cells}
    assert by["ddp x2 batch 64"].run_key() == by["ddp x2"].run_key()
    assert "optim.base_batch" not in by["ddp x2 batch 64"].overrides()
    assert by["ddp x2 batch 128"].overrides()["optim.base_batch"] is None


def test_comm_hook_cells_only_for_the_strategies_asked_for():
    spec = dataclasses.replace(quick_spec(), strategies=["single", "fsdp"], baseline=False, trap=False)
    labels = [c.label for c in build_matrix(spec, TrainConfig(), train_size=1438)]
    assert not [label for label in labels if "hook=" in label], labels


def test_config_errors_become_skip_reasons():
    spec = dataclasses.replace(quick_spec(), strategies=["pipeline"], precisions=["fp16-mixed"],
                               comm_hooks=["none"], baseline=False, trap=False)
    cells = {c.label: c.skip for c in build_matrix(spec, TrainConfig(), train_size=1438)}
    assert "fp16-mixed is not supported with strategy pipeline" in cells["pipeline x2 fp16-mixed"]
    with pytest.raises(ValueError, match="strategy 'nosuch' is unknown"):  # a name, unlike a setting, is checked up front
        dataclasses.replace(spec, strategies=["pipeline", "nosuch"])


def test_recommendation_is_fastest_within_accuracy_tolerance():
    def res(label_cell, spe, acc):
        return CellResult(cell=label_cell, status="ok", seconds_per_epoch=spe, test_accuracy=acc, samples_per_s=1.0)

    single = res(Cell(strategy="single", global_batch=64), 1.0, 0.90)
    slow = res(Cell(strategy="ddp", world_size=2, global_batch=64), 0.6, 0.90)
    fast_bad = res(Cell(strategy="ddp", world_size=2, global_batch=128, group="trap"), 0.3, 0.80)
    baseline = res(Cell(strategy="plain-ddp", world_size=2, global_batch=64, group="baseline"), 0.1, 0.90)
    assert recommend([single, slow, fast_bad, baseline], tolerance=0.02) is slow
    # a cell that grew the global batch trains something else: never recommended, however close
    assert recommend([single, slow, fast_bad, baseline], tolerance=0.2) is slow
    kept = res(Cell(strategy="ddp", world_size=2, global_batch=64, group="trap"), 0.5, 0.90)
    assert recommend([single, slow, fast_bad, kept], tolerance=0.2) is kept


def test_recommendation_takes_the_simpler_configuration_within_noise():
    def res(cell, spe):
        return CellResult(cell=cell, status="ok", seconds_per_epoch=spe, test_accuracy=0.9, samples_per_s=1.0)

    single = res(Cell(strategy="single", global_batch=64), 1.0)
    devices = res(Cell(strategy="devices", global_batch=64), 0.97)  # one process, 3% faster: noise
    ddp = res(Cell(strategy="ddp", world_size=2, global_batch=64), 0.96)
    assert recommend([devices, single, ddp], tolerance=0.02) is single
    faster = res(Cell(strategy="ddp", world_size=2, global_batch=64), 0.6)
    assert recommend([devices, single, faster], tolerance=0.02) is faster


def test_a_mesh_is_a_cell_at_each_world_size_it_makes():
    spec = BenchSpec(strategies=["ddp"], world_sizes=[2, 4, 8], precisions=["32"], comm_hooks=["none"],
                     meshes=["pp=2,dp_shard=-1", "tp=2, dp_replicate=2"], baseline=False, trap=False, nccl_cells=False)
    cells = [c for c in build_matrix(spec, TrainConfig(), train_size=1438) if c.group == "mesh"]
    assert [c.label for c in cells] == ["mesh pp=2,dp_shard=-1 x2", "mesh pp=2,dp_shard=-1 x4", "mesh pp=2,dp_shard=-1 x8",
                                        "mesh dp_replicate=2,tp=2 x4", "mesh dp_replicate=2,tp=2 x8"]
    assert cells[0].strategy == "pipeline" and cells[-1].strategy == "mesh"
    assert cells[1].overrides()["parallel.mesh"] == "pp=2,dp_shard=-1"
    with pytest.raises(ValueError, match=r"^mesh pp=3 makes none of the world sizes 2,4: add 3 to the world sizes$"):
        BenchSpec(world_sizes=[2, 4], meshes=["pp=3"])
    with pytest.raises(ValueError, match="is not NAME=SIZE"):
        BenchSpec(meshes=["pp2"])


def test_bad_matrix_values_are_one_line_errors():
    with pytest.raises(ValueError, match="world sizes"):
        BenchSpec(world_sizes=[0])
    r = run_cli(["bench", "--precisions", "fp4"], timeout=60)
    assert r.returncode == 2 and "precision 'fp4' is unknown" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # the user's own model is built once before any launch: its mistakes are one line, not a table of failures
    r = run_cli(["bench", "--quick", "--model", "tests/scripts/user_task.py:no_such_function"], timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "has no function 'no_such_function'" in lines[0], r.stderr
    assert "configuration" not in r.stdout


@pytest.mark.timeout(650)
def test_bench_small_matrix_writes_table_json_csv_and_png(tmp_path):
    out = tmp_path / "bench"
    r = run_cli(["bench", "--strategies", "single,dp,ddp", "--world-sizes", "1,2", "--precisions", "32",
                 "--comm-hooks", "none,fp16", "--epochs", "1", "--warmup-steps", "2", "--cell-timeout", "90",
                 "--no-progress", "--out", str(out)], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout
    for text in ("configuration", "s/epoch", "samples/s", "speed-up", "effic.", "peak MiB", "comm/step",
                 "test acc", "effective-batch trap", "hand-written", "recommendation:"):
        assert text in table

    data = json.loads((out / "results.json").read_text())
    cells = {c["label"]: c for c in data["cells"]}
    expected = {"single", "dp x2", "ddp x2", "ddp x2 hook=fp16", "plain DDP (hand-written) x2",
                "ddp x2 batch 64", "ddp x2 batch 128"} | ({"ddp x2 nccl"} if NO_GPU else set())
    assert expected <= set(cells)
    scaled = [c for label, c in cells.items() if label.startswith("ddp x2 batch 128 lr x2 + warmup")]
    assert len(scaled) == 1 and scaled[0]["status"] == "ok"
    assert len(data["cells"]) == len(expected) + 1
    if NO_GPU:
        assert cells["dp x2"]["status"] == "skipped" and "GPUs" in cells["dp x2"]["reason"]
        assert cells["ddp x2 nccl"]["status"] == "skipped" and "nccl" in cells["ddp x2 nccl"]["reason"]
        assert "dp x2" in table and cells["dp x2"]["reason"] in table
    for c in data["cells"]:
        if c["status"] == "ok":
            assert c["samples_per_s"] > 0 and c["seconds_per_epoch"] > 0
            # the baseline's processes also run paratrain's loop (the overhead): no peak of its own
            assert c["peak_mem_mib"] is None if c["group"] == "baseline" else c["peak_mem_mib"] > 0
            assert 0.0 <= c["test_accuracy"] <= 1.0 and c["final_loss"] > 0
    # Same global batch: paratrain's ddp trains exactly what one process trains. Accuracy counts
    # argmax hits (one test sample is 1/359 = 2.8e-3): < 1e-9 means the same count, only the
    # division may round.
    assert abs(cells["ddp x2"]["test_accuracy"] - cells["single"]["test_accuracy"]) < 1e-9
    assert cells["single"]["speedup"] == pytest.approx(1.0)  # its own time over itself: 1 up to float division
    # Bytes: the whole fp32 gradient once per step; the fp16 hook sends half, the hand-written loop the same.
    assert cells["ddp x2"]["comm_bytes_per_step"] == MLP_DIGITS_GRAD_BYTES
    assert cells["ddp x2 hook=fp16"]["comm_bytes_per_step"] == MLP_DIGITS_GRAD_BYTES / 2
    assert cells["plain DDP (hand-written) x2"]["comm_bytes_per_step"] == MLP_DIGITS_GRAD_BYTES
    assert data["recommendation"] in cells

    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["label"] for row in rows] == [c["label"] for c in data["cells"]]
    assert {"status", "reason", "samples_per_s", "test_accuracy", "comm_bytes_per_step"} <= set(rows[0])

    png = (out / "chart.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(out / "chart.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def _count_each_kind(local_rank):
    from torch.distributed import _functional_collectives as funcol

    from paratrain.bench.measure import CommCounter

    d = paratrain.init(timeout_s=30)
    t = torch.ones(10)  # 40 bytes
    counter = CommCounter().install()
    steps = []
    for count in (True, False, True):
        before = counter.bytes
        with counter.step(count=count):
            if count and not steps:
                dist.all_reduce(t)  # a Python collective: counted by its wrapper, once
            funcol.all_reduce(t, "sum", dist.group.WORLD).wait()  # functional (DTensor's kind): the dispatch mode
        steps.append(counter.bytes - before)
    counter.uninstall()
    counter = CommCounter().install()
    peer = 1 - d.rank
    with counter.step(count=True):
        # P2POp still accepts dist.isend (it checks for the original function); sends are counted once
        ops = [dist.P2POp(dist.isend, torch.ones(8), peer), dist.P2POp(dist.irecv, torch.zeros(8), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    counter.uninstall()
    paratrain.destroy()
    return steps, counter.bytes, counter.calls


def test_comm_counter_sees_python_functional_and_p2p_calls_once():
    for steps, p2p_bytes, p2p_calls in paratrain.launch(_count_each_kind, nprocs=2, timeout=90):
        # no warm-up step yet: the mode runs in the counted step; then a warm-up step measures
        # the functional bytes and the next counted step is credited them, without the mode
        assert steps == [80, 0, 40]
        assert (p2p_bytes, p2p_calls) == (32, 1)


@pytest.mark.timeout(400)
def test_bench_counts_tensor_and_pipeline_bytes(tmp_path):
    out = tmp_path / "bench"
    r = run_cli(["bench", "--strategies", "tensor,pipeline", "--world-sizes", "2", "--precisions", "32",
                 "--comm-hooks", "none", "--epochs", "1", "--warmup-steps", "2", "--cell-timeout", "90",
                 "--no-baseline", "--no-trap", "--no-progress", "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    cells = {c["label"]: c for c in json.loads((out / "results.json").read_text())["cells"]}
    assert {label: c["status"] for label, c in cells.items()} == {"tensor x2": "ok", "pipeline x2": "ok"}, cells
    # tensor: fc1 column-wise, fc2 row-wise: one all-reduce of fc2's output (global batch 64 x 10
    # logits, fp32) per forward; the backward needs none, as the input needs no gradient.
    assert cells["tensor x2"]["comm_bytes_per_step"] == 4 * 64 * 10
    # pipeline: stage 1 is flatten + fc1, so rank 0 sends fc1's output (64 x 512, fp32, in 4
    # micro-batches), plus the 4-byte mean loss the last stage broadcasts (a broadcast counts on every rank).
    assert cells["pipeline x2"]["comm_bytes_per_step"] == 4 * 64 * 512 + 4
    # each byte under the layout dimension whose process group carried it
    assert cells["tensor x2"]["comm_by_dimension"] == {"tp": 4 * 64 * 10}
    assert cells["pipeline x2"]["comm_by_dimension"] == {"pp": 4 * 64 * 512 + 4}
    assert "comm_bytes_tp" in (out / "results.csv").read_text().splitlines()[0]
    rows = {line.split("  ")[0]: line for line in r.stdout.splitlines() if line.startswith(("tensor", "pipeline"))}
    assert "2.5 KiB" in rows["tensor x2"] and "128.0 KiB" in rows["pipeline x2"]
    assert "n/a" not in rows["tensor x2"]


def test_report_from_results_without_running(tmp_path):
    single = CellResult(cell=Cell(strategy="single", global_batch=64), status="ok", seconds_per_epoch=1.0,
                        samples_per_s=1400.0, speedup=1.0, efficiency=1.0, peak_mem_mib=300.0, skipped_steps=0,
                        final_loss=0.2, test_accuracy=0.95, mem_method="rss")
    dp = CellResult(cell=Cell(strategy="dp", world_size=2, global_batch=64), status="skipped",
                    reason="DataParallel over 2 GPUs needs 2 GPUs in one process; 0 visible")
    spec = dataclasses.asdict(quick_spec())
    res = BenchResult(meta={"machine": {"cpu": "cpu", "logical_cores": 2, "gpus": 0, "gpu": None, "torch": "x",
                                        "load_avg_start": 1.0},
                            "model": "mlp", "dataset": "digits", "train_size": 1438, "global_batch": 64,
                            "optimizer": "sgd", "lr": 0.05, "spec": spec, "memory": "rss"},
                      results=[single, dp], recommendation=single)
    table = format_table(res)
    assert "dp x2" in table and "skipped: DataParallel over 2 GPUs" in table and "recommendation: single" in table
    paths = write_all(res, str(tmp_path))
    assert json.loads(open(paths["json"]).read())["cells"][1]["reason"].startswith("DataParallel")


def test_full_matrix_has_devices_sequential_and_pipelined_quick_has_neither():
    cells = {c.label: c for c in build_matrix(BenchSpec(), TrainConfig(), train_size=1438)}
    assert cells["devices"].micro_batches == 1 and cells["devices"].skip is None
    piped = cells["devices pipelined x4 micro-batches"]
    assert piped.skip is None and piped.overrides()["parallel.devices.micro_batches"] == 4
    assert piped.run_key() != cells["devices"].run_key()
    assert "parallel.devices.micro_batches" not in cells["devices"].overrides()
    assert not any(c.micro_batches != 1 for label, c in cells.items() if not label.startswith("devices"))
    assert not any(c.strategy == "devices" for c in build_matrix(quick_spec(), TrainConfig(), train_size=1438))
    none = build_matrix(BenchSpec(strategies=["devices"], micro_batches=1), TrainConfig(), train_size=1438)
    assert none and all(c.micro_batches == 1 for c in none)


def test_precision_aliases_become_canonical_cells():
    """fp32/O0 are the fp32 reference ("32"), bf16 and O1 their mixed modes; one cell per precision."""
    spec = BenchSpec(strategies=["single"], world_sizes=[1], precisions=["fp32", "32", "O0", "bf16", "O1"],
                     comm_hooks=["none"], baseline=False, trap=False)
    assert spec.precisions == ["32", "bf16-mixed", "fp16-mixed"]
    from paratrain.config import TrainConfig

    cells = build_matrix(spec, TrainConfig(), train_size=1438)
    assert sorted(c.precision for c in cells) == ["32", "bf16-mixed", "fp16-mixed"]


def test_unsynced_batchnorm_is_noted_before_multi_process_cells(capsys):
    from paratrain.cli.bench import check_model
    from paratrain.config import TrainConfig

    cnn = TrainConfig.load(None, {"model": "cnn"})
    check_model(cnn, multi_process=False)
    check_model(TrainConfig.load(None, {"model": "mlp"}), multi_process=True)
    assert capsys.readouterr().err == ""
    check_model(cnn, multi_process=True)
    assert "note: the model has BatchNorm layers and --sync-bn is off" in capsys.readouterr().err


def test_a_cells_schedule_spans_the_cells_run(monkeypatch):
    """A cosine or linear schedule in bench's job once spanned one step: every cell after it
    trained at lr ~0."""
    import paratrain.loop.train as train
    from paratrain.bench import worker
    from paratrain.parallel import Parallel

    class Stop(Exception):
        pass

    seen = []

    def setup_task(pt, cfg, total_steps):
        seen.append(total_steps)
        raise Stop

    monkeypatch.setattr(train, "setup_task", setup_task)
    cfg = TrainConfig.load(None, {"model": "mlp", "data.dataset": "synthetic", "data.synthetic_size": 256,
                                  "parallel.global_batch": 32, "epochs": 3, "optim.schedule": "cosine"})
    pt = Parallel(cfg.parallel)
    with pytest.raises(Stop):
        worker._train_paratrain(pt, None, cfg, {"warmup_steps": 1}, cfg.dataset(train=True), None)
    pt.close()
    assert seen == [3 * 256 // 32]
