"""The scaling predictor's arithmetic against cases worked out by hand (no timing)."""

import math

import pytest

from paratrain.bench.predict import (BUCKET_BYTES, Link, Nodes, Workload, all_reduce_s, fit_link, format_predictions,
                                     gather_s, predict, ring_all_reduce_s, ring_gather_s, scheme_comm_s)

# 1 ms latency, 1 MB/s: the hand computations below are in milliseconds and megabytes.
SLOW = Link(1e-3, 1e6)


def test_link_parse():
    link = Link.parse("100gbit,5us")
    assert link.bandwidth == pytest.approx(12.5e9) and link.latency_s == pytest.approx(5e-6)
    link = Link.parse("2ms, 1.5GB/s")
    assert link.bandwidth == pytest.approx(1.5e9) and link.latency_s == pytest.approx(2e-3)
    assert Link.parse("25gbps,10us").bandwidth == pytest.approx(25e9 / 8)
    for bad in ("100gbit", "5us", "100 furlongs,5us", "100gbit,5us,7us"):
        with pytest.raises(ValueError, match="--link"):
            Link.parse(bad)


def test_ring_collectives_by_hand():
    # all-reduce of 3 MB over 4 workers: 2*3 steps of 1 ms + 2*3/4 * 3 MB at 1 MB/s = 6 ms + 4.5 s
    assert ring_all_reduce_s(3e6, 4, SLOW) == pytest.approx(0.006 + 4.5)
    # at 2 workers the factor 2(N-1)/N is 1: 2 ms + 3 s
    assert ring_all_reduce_s(3e6, 2, SLOW) == pytest.approx(3.002)
    # all-gather of 3 MB over 4 workers: 3 ms + 3/4 * 3 s
    assert ring_gather_s(3e6, 4, SLOW) == pytest.approx(0.003 + 2.25)
    assert ring_all_reduce_s(3e6, 1, SLOW) == ring_gather_s(3e6, 1, SLOW) == 0.0


def test_two_level_collectives_by_hand():
    # 4 workers per node on a 1 us, 1 GB/s node link; nodes on SLOW (1 ms, 1 MB/s)
    fast = Link(1e-6, 1e9)
    nodes = Nodes(4, fast)
    assert nodes.split(16) == (4, 4) and nodes.split(2) == (2, 1) and nodes.split(6) == (4, 2)
    # all-reduce of 3 MB over 16 workers = 4 nodes:
    #   reduce-scatter in the node: 3 us + 3/4 * 3 ms; all-gather in the node: the same;
    #   all-reduce across 4 nodes: 2*3 ms + 2*3/4 * 3 s (the node's 4 rings share its link)
    in_node = 3e-6 + 0.75 * 3e-3
    assert all_reduce_s(3e6, 16, SLOW, nodes) == pytest.approx(2 * in_node + 0.006 + 4.5)
    # flat, every one of the 16 hops is a network hop: 2*15 ms of latency instead of 2*3 ms
    assert all_reduce_s(3e6, 16, SLOW) == pytest.approx(0.030 + 2 * 15 / 16 * 3.0)
    # inside one node only the node link is used
    assert all_reduce_s(3e6, 4, SLOW, nodes) == pytest.approx(ring_all_reduce_s(3e6, 4, fast))
    # all-gather of 3 MB over 16: one level in the node, one across the 4 nodes (3 ms + 3/4 * 3 s)
    assert gather_s(3e6, 16, SLOW, nodes) == pytest.approx(in_node + 0.003 + 2.25)
    # a node of one worker is the flat ring
    assert all_reduce_s(3e6, 8, SLOW, Nodes(1, fast)) == pytest.approx(ring_all_reduce_s(3e6, 8, SLOW))
    w = Workload(compute_s=1.0, batch_per_worker=32, shapes=((1000, 1000),))
    assert scheme_comm_s("sharded (fsdp)", w, 16, SLOW, nodes) == pytest.approx(3 * gather_s(4e6, 16, SLOW, nodes))
    flat, two = (predict(w, SLOW, ["all-reduce (ddp)"], [64], nd)[0] for nd in (None, nodes))
    assert two.efficiency > flat.efficiency
    with pytest.raises(ValueError, match="--workers-per-node 0"):
        Nodes(0, fast)
    assert "4 workers per node" in format_predictions(w, SLOW, [two], nodes)


def test_schemes_by_hand():
    # 1M parameters in a 1000x1000 matrix: 4 MB of fp32 gradients, one bucket
    w = Workload(compute_s=1.0, batch_per_worker=32, shapes=((1000, 1000),), powersgd_rank=2)
    n = 4
    assert scheme_comm_s("all-reduce (ddp)", w, n, SLOW) == pytest.approx(0.006 + 1.5 * 4.0)
    assert scheme_comm_s("fp16 all-reduce", w, n, SLOW) == pytest.approx(0.006 + 1.5 * 2.0)
    # PowerSGD rank 2: P (1000x2) and Q (1000x2) = 4000 floats = 16 kB, in two all-reduces
    assert w.powersgd_floats() == 4000
    assert scheme_comm_s("PowerSGD all-reduce", w, n, SLOW) == pytest.approx(2 * 0.006 + 1.5 * 0.016)
    # FSDP: two all-gathers and a reduce-scatter of 4 MB, each 3 ms + 3/4 * 4 s
    assert scheme_comm_s("sharded (fsdp)", w, n, SLOW) == pytest.approx(3 * (0.003 + 3.0))
    with pytest.raises(ValueError, match="unknown"):
        scheme_comm_s("zero", w, n, SLOW)


def test_buckets_pay_latency_each():
    # 100M parameters = 400 MB = 16 buckets of 25 MiB: latency 16 times, bytes once
    w = Workload.from_params(100_000_000, 1.0, 32)
    assert w.buckets(4e8) == math.ceil(4e8 / BUCKET_BYTES) == 16
    link = Link(1e-3, 1e9)
    assert scheme_comm_s("all-reduce (ddp)", w, 8, link) == pytest.approx(16 * 2 * 7 * 1e-3 + 2 * 7 / 8 * 0.4)


def test_powersgd_keeps_vectors_and_conv_weights_as_matrices():
    w = Workload(1.0, 1, ((64, 3, 3, 3), (64,), (10, 64)), powersgd_rank=4)
    # conv 64 x 27: 4*(64+27) = 364; bias 64 whole; 10x64: 4*74 = 296 > 640? no: min(296, 640) = 296
    assert w.powersgd_floats() == 364 + 64 + 296
    assert Workload(1.0, 1, ((3, 3),), powersgd_rank=4).powersgd_floats() == 9  # never more than plain


def test_predict_samples_and_efficiency():
    w = Workload(compute_s=2.0, batch_per_worker=10, shapes=((1000, 1000),), exposed=0.5)
    (p,) = predict(w, SLOW, ["all-reduce (ddp)"], [4])
    comm = 0.006 + 6.0
    assert p.comm_s == pytest.approx(comm)
    assert p.step_s == pytest.approx(2.0 + 0.5 * comm)
    assert p.samples_per_s == pytest.approx(40 / (2.0 + 0.5 * comm))
    assert p.efficiency == pytest.approx(2.0 / (2.0 + 0.5 * comm))
    hidden = predict(Workload(2.0, 10, ((1000, 1000),), exposed=0.0), SLOW, ["sharded (fsdp)"], [1024])[0]
    assert hidden.efficiency == 1.0 and hidden.samples_per_s == pytest.approx(1024 * 10 / 2.0)


def test_efficiency_falls_with_workers_and_compression_helps():
    w = Workload.from_params(25_600_000, 0.2, 32)
    link = Link.parse("25gbit,10us")
    preds = {(p.scheme, p.workers): p for p in predict(w, link, ["all-reduce (ddp)", "fp16 all-reduce", "sharded (fsdp)"])}
    effs = [preds[("all-reduce (ddp)", n)].efficiency for n in (2, 4, 8, 1024)]
    assert effs == sorted(effs, reverse=True)
    assert preds[("fp16 all-reduce", 64)].efficiency > preds[("all-reduce (ddp)", 64)].efficiency > preds[("sharded (fsdp)", 64)].efficiency


def test_fit_link_recovers_a_known_link():
    link = Link(20e-6, 2e9)
    samples = [(s, ring_all_reduce_s(s, 2, link)) for s in (4e3, 1e6, 16e6)]
    fitted = fit_link(samples, 2)
    assert fitted.latency_s == pytest.approx(20e-6) and fitted.bandwidth == pytest.approx(2e9)
    with pytest.raises(ValueError, match="two sizes"):
        fit_link([(1e6, 0.1), (1e6, 0.2)])


def test_workload_and_table():
    with pytest.raises(ValueError, match="exposed"):
        Workload(1.0, 1, ((1,),), exposed=1.5)
    w = Workload(0.5, 8, ((100, 10),))
    text = format_predictions(w, SLOW, predict(w, SLOW, ["all-reduce (ddp)", "sharded (fsdp)"], [2, 4]))
    assert "1,000 parameters" in text and "all-reduce (ddp)" in text and "sharded (fsdp)" in text
    assert len(text.splitlines()) == 4 + 2


def test_bench_flags_and_the_prediction_from_a_bench_result(tmp_path):
    import argparse

    from paratrain.bench.matrix import Cell
    from paratrain.bench.runner import BenchResult, CellResult
    from paratrain.bench.scaling import exposed_fraction, predict_from_bench
    from paratrain.cli.bench import add_parser
    from paratrain.config import TrainConfig

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--predict", "--link", "1gbit,1ms", "--exposed", "0.5"])
    assert (args.predict, args.link, args.exposed) == (True, "1gbit,1ms", 0.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--link", "fast"])
    from paratrain.cli.bench import check_nodes

    check_nodes(parser.parse_args(["bench", "--predict", "--workers-per-node", "8", "--node-link", "300GB/s,2us"]))
    for argv, message in ((["--predict", "--workers-per-node", "8"], "needs --node-link"),
                          (["--predict", "--node-link", "300GB/s,2us"], "needs --workers-per-node above 1"),
                          (["--workers-per-node", "8", "--node-link", "300GB/s,2us"], "add --predict"),
                          (["--predict", "--workers-per-node", "0"], "--workers-per-node 0")):
        with pytest.raises(ValueError, match=message):
            check_nodes(parser.parse_args(["bench", *argv]))

    single = CellResult(cell=Cell(strategy="single", global_batch=64), status="ok", step_time_s=1.0)
    ddp2 = CellResult(cell=Cell(strategy="ddp", world_size=2, global_batch=64), status="ok", step_time_s=0.75)
    result = BenchResult(meta={}, results=[single, ddp2])
    # 1M float32 gradients over 1 ms, 4 MB/s: 2 ms + 1 s at 2 workers; 0.75 = 1.0/2 + 0.25 -> exposed ~0.25
    w = Workload(1.0, 64, ((1000, 1000),))
    assert exposed_fraction(result, w, Link(1e-3, 4e6)) == pytest.approx(0.25 / 1.002)
    cfg = TrainConfig.load(None, {"model": "mlp", "data.dataset": "synthetic"})
    text = predict_from_bench(result, cfg, "1gbit,1ms", 0.5, str(tmp_path))
    assert "exposed fraction 0.50: given" in text and "1024 |" in text
    text = predict_from_bench(result, cfg, "1gbit,1ms", 0.5, str(tmp_path), 8, "300GB/s,2us")
    assert "8 workers per node joined by" in text and "--node-link 300GB/s,2us" in text


# Recorded on one H200 machine's host (16 cores, torch 2.11.0+cu130, 2026-12-04): the device check's
# predict step (resnet8, 32 samples a worker, loopback gloo): (bytes, median seconds) of gloo
# all-reduces between 2, 4 and 8 processes, one worker's step alone and ddp's step at 4 and 8.
H200_ALL_REDUCE = {
    2: [(4096, 1.796e-4), (65536, 1.800e-4), (1048576, 4.587e-4), (4194304, 1.680e-3), (16777216, 5.779e-3)],
    4: [(4096, 5.65e-4), (65536, 4.41e-4), (1048576, 8.24e-4), (4194304, 2.177e-3), (16777216, 7.525e-3)],
    8: [(4096, 9.08e-4), (65536, 1.000e-3), (1048576, 1.394e-3), (4194304, 2.691e-3), (16777216, 1.1458e-2)],
}
H200_SINGLE_S, H200_DDP_S = 46.79e-3, {4: 55.13e-3, 8: 69.92e-3}


def test_the_2_process_link_predicts_gloos_all_reduces_at_4_and_8_recorded_on_a_16_core_host():
    """Issue 38 item 3: the ring model with the link fitted at 2 processes against gloo's all-reduces
    measured at 4 and 8 on one host: within 35% at every size (it over-predicts more often than not:
    gloo's own copies and reductions cost no more at 8 than the ring's steps say)."""
    link = fit_link(H200_ALL_REDUCE[2], 2)
    for n in (4, 8):
        for nbytes, measured in H200_ALL_REDUCE[n]:
            predicted = ring_all_reduce_s(nbytes, n, link)
            assert abs(predicted - measured) / measured < 0.35, (n, nbytes, predicted, measured)


def test_what_the_recorded_ddp_steps_lack_is_compute_not_communication():
    """The same run's ddp steps: even with all of the gradients' all-reduce exposed, communication
    explains under a tenth of the gap to one worker alone; the rest is compute that slows down when 4
    or 8 processes share the host (docs/predict.md), which the predictor leaves out."""
    from paratrain.config import TrainConfig

    model = TrainConfig.load(None, {"model": "resnet8", "data.dataset": "synthetic"}).build_model()
    w = Workload(H200_SINGLE_S, 32, tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad), 1.0)
    link = fit_link(H200_ALL_REDUCE[2], 2)
    for n in (4, 8):
        comm = scheme_comm_s("all-reduce (ddp)", w, n, link)  # the check printed 0.65 ms at 4, 1.34 ms at 8
        gap = H200_DDP_S[n] - H200_SINGLE_S
        assert 0.3e-3 < comm < 0.1 * gap, (n, comm, gap)


# The next run on the same machine kind (2026-12-04, second session): one worker's step (bench's single cell),
# the bare step with 1, 4 and 8 processes running it at once (concurrent_compute), ddp measured at 4 and 8.
H200_RUN2 = {"single": 49.21e-3, "together": {1: 46.57e-3, 4: 54.83e-3, 8: 77.84e-3},
             "ddp": {4: 75.95e-3, 8: 90.54e-3},
             "all_reduce_2": [(4096, 1.6615e-4), (65536, 1.6526e-4), (1048576, 5.1824e-4), (4194304, 1.88273e-3),
                              (16777216, 6.14137e-3)]}


def test_with_the_compute_of_n_at_once_the_predictor_is_within_25_percent_at_4_and_8_recorded_on_a_16_core_host():
    """Issue 38 item 3: ddp at 4 and 8 processes on one host's cores, predicted with one worker's compute
    measured with 4 and 8 at once (Workload.together) and the 2-process link: within 25% (it was -34% and -44%
    with the compute of one alone)."""
    from paratrain.config import TrainConfig

    model = TrainConfig.load(None, {"model": "resnet8", "data.dataset": "synthetic"}).build_model()
    shapes = tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)
    single, together = H200_RUN2["single"], H200_RUN2["together"]
    link = fit_link(H200_RUN2["all_reduce_2"], 2)
    w = Workload(single, 32, shapes, 1.0, together=tuple((n, single * t / together[1]) for n, t in together.items()))
    alone = Workload(single, 32, shapes, 1.0)
    for n, measured in H200_RUN2["ddp"].items():
        (p,) = predict(w, link, ["all-reduce (ddp)"], [n])
        (q,) = predict(alone, link, ["all-reduce (ddp)"], [n])
        assert abs(p.step_s - measured) / measured < 0.25, (n, p.step_s, measured)
        assert (q.step_s - measured) / measured < -0.3, (n, q.step_s, measured)  # what it was without
    with pytest.raises(ValueError, match="must be positive"):
        Workload(single, 32, shapes, together=((0, 1.0),))


def test_bench_predict_on_this_host_measures_n_at_once_and_sets_the_prediction_beside_the_ddp_cells():
    """The on-host table of ``bench --predict`` (no --link, cells on the CPU), from a bench result's single and
    ddp x2 cells: a real measurement of the bare step with 1 process at the whole batch and 2 at once at half."""
    from paratrain.bench.matrix import Cell
    from paratrain.bench.predict import Link
    from paratrain.bench.runner import BenchResult, CellResult
    from paratrain.bench.scaling import on_this_host
    from paratrain.config import TrainConfig

    cfg = TrainConfig.load(None, {"model": "mlp", "data.dataset": "synthetic", "data.synthetic_size": 64,
                                  "parallel.accelerator": "cpu"})
    single = CellResult(cell=Cell(strategy="single", global_batch=32), status="ok", step_time_s=0.004)
    ddp2 = CellResult(cell=Cell(strategy="ddp", world_size=2, global_batch=32), status="ok", step_time_s=0.0035)
    shapes = tuple(tuple(p.shape) for p in cfg.build_model().parameters())
    text = on_this_host(BenchResult(meta={}, results=[single, ddp2]), cfg, shapes, Link(1e-4, 1e9), threads=1, timeout=90)
    assert text.startswith("on this host"), text
    row = text.splitlines()[-1].split("|")
    assert [c.strip() for c in row[:2]] == ["2", "16"] and row[4].strip() == "3.5 ms", text
    assert row[3].strip().endswith("ms") and row[5].strip().endswith("%"), text
    assert on_this_host(BenchResult(meta={}, results=[single]), cfg, shapes, Link(1e-4, 1e9), threads=1) == ""
