"""Choosing the layout (``paratrain estimate --world N``): the candidates, where each dimension's group
runs, the predicted step's parts by hand, and the order (what fits first, highest throughput first)."""

from __future__ import annotations

import pytest
from clitools import run_cli

from paratrain.bench.layouts import _group_link, _predict, candidate_layouts, choose_layouts
from paratrain.bench.memory import ModelFacts
from paratrain.bench.predict import Link

NET, NODE = Link(1e-5, 1e9), Link(1e-6, 1e11)


def facts(**kw) -> ModelFacts:
    base = dict(params=1000, largest_block=200, root_params=200, linear_params=800, largest_stage=600,
                activation_bytes=5000.0, largest_saved_bytes=10.0, largest_param=200, largest_linear=True, blocks=4,
                block_input_bytes=400.0, forward_flops=1e6, stage_params={2: 600, 4: 400, 8: 200})
    base.update(kw)
    return ModelFacts(**base)


def test_the_candidates_make_the_world_and_keep_tp_in_a_node():
    layouts = candidate_layouts(8, per_node=4, max_stages=4)
    assert all(s["pp"] * s["dp_replicate"] * s["dp_shard"] * s["tp"] == 8 for s in layouts)
    assert max(s["tp"] for s in layouts) == 4 and max(s["pp"] for s in layouts) == 4
    assert len({tuple(s.values()) for s in layouts}) == len(layouts)
    assert {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "tp": 1} in layouts
    assert {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2} in layouts


def test_a_dimension_runs_inside_a_node_across_nodes_or_both():
    sizes = {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}  # 8 ranks, 4 to a node
    assert _group_link(sizes, "tp", 4, NET, NODE) == (NODE, None)  # ranks 0,1
    assert _group_link(sizes, "dp_shard", 4, NET, NODE) == (NODE, None)  # ranks 0,2
    assert _group_link(sizes, "pp", 4, NET, NODE) == (NET, None)  # ranks 0,4: another node
    link, nodes = _group_link({"pp": 1, "dp_replicate": 1, "dp_shard": 8, "tp": 1}, "dp_shard", 4, NET, NODE)
    assert link == NET and nodes is not None and nodes.per_node == 4  # two levels


def test_the_predicted_step_by_hand():
    f = facts()
    compute, bubble, comm = _predict(f, {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 2}, 8, 4, 1e9, 4, NET, NODE)
    assert compute == pytest.approx(3 * 1e6 * 8 * 0.6 / 2 / 1e9)
    assert bubble == pytest.approx(compute / 4)
    block_input = 400 / 4 * 8  # one block's input, 8 samples
    tp_one = 2 * 1 * 1e-6 + 2 * 1 / 2 * block_input / 1e11  # a ring all-reduce over 2, inside the node
    assert comm["tp"] == pytest.approx(4 * 2 * tp_one)  # 4 per block, 2 of the 4 blocks on the stage
    assert comm["pp"] == pytest.approx(2 * (1e-6 + block_input / 4 / 1e11))  # ranks 0 and 2: one node
    assert set(comm) == {"tp", "pp"}


def test_what_fits_comes_first_then_the_highest_throughput():
    f = facts()
    choices = choose_layouts(f, 8, 2, 8, device_memory=2 * 2**20, tflops=1e-3, link=NET, node_link=NODE, device="cpu")
    fits = [c.fits for c in choices]
    assert fits == sorted(fits, reverse=True) and any(fits)
    rates = [c.samples_per_s(8) for c in choices if c.fits]
    assert rates == sorted(rates, reverse=True)
    tight = choose_layouts(f, 8, 2, 8, device_memory=1, link=NET, node_link=NODE)
    assert not any(c.fits for c in tight)
    with pytest.raises(ValueError, match="--world 6 on --nodes 4"):
        choose_layouts(f, 6, 4, 8, device_memory=1)


def test_cli_lists_the_layouts_of_a_world():
    r = run_cli(["estimate", "--model", "transformer", "--world", "4", "--nodes", "2", "--device-memory", "1GiB",
                 "--device", "cpu"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "layouts of 4 workers on 2 node(s)" in r.stdout and "samples/s" in r.stdout
    assert "layouts fit" in r.stdout.splitlines()[-1]
    bad = run_cli(["estimate", "--world", "4"], timeout=60)
    assert bad.returncode != 0 and "--world needs --device-memory" in bad.stderr
