"""The suite's own scheduling (tests/workunits.py): what must not run beside itself stays in one worker; the
worker beyond the cores runs only the tests that mostly wait."""

import types

import pace
import pytest
import workunits
from workunits import scheduler, waits, work_unit


def test_the_labs_tests_are_one_unit_whatever_their_module():
    assert work_unit("tests/lab/test_slurm.py::test_a") == work_unit("tests/lab/test_mpi.py::test_b[openmpi]") == "lab"


def test_a_module_with_a_module_scoped_fixture_is_one_unit_and_others_split_by_test():
    # tests/env/test_preemption.py trains its uninterrupted reference once per module
    assert work_unit("tests/env/test_preemption.py::test_x[SIGTERM]") == work_unit(
        "tests/env/test_preemption.py::test_y[SIGUSR1]") == "tests/env/test_preemption.py"
    assert work_unit("tests/test_clock.py::test_a") == "tests/test_clock.py::test_a"
    assert work_unit("tests/test_package.py::test_wheel") == "package"  # its builds write the checkout


HANGS = "tests/trace/test_hangs.py::test_launch_names_the_rank_the_collective_and_the_step"


def test_the_waits_mark_is_read_from_the_source_and_a_waiting_test_is_a_unit_of_its_own():
    assert waits(f"{HANGS}[other]") and not waits("tests/trace/test_hangs.py::test_doctor_on_a_folder_without_records_is_one_line")
    # in a module whose other tests share a trained fixture
    grace = "tests/env/test_preemption.py::test_a_save_past_the_grace_period_leaves_the_previous_checkpoint_newest"
    assert waits(grace) and work_unit(grace) == grace


def test_a_waiting_test_of_a_group_stays_in_its_group(monkeypatch):
    monkeypatch.setitem(workunits._waits, "tests/lab/test_slurm.py", frozenset({"test_a"}))
    assert waits("tests/lab/test_slurm.py::test_a") and work_unit("tests/lab/test_slurm.py::test_a") == "lab"


def test_the_worker_beyond_the_cores_takes_only_waiting_tests_and_the_others_take_them_last(monkeypatch):
    monkeypatch.setattr(pace, "cores", lambda: 2)
    config = types.SimpleNamespace(getvalue=lambda name: {"tx": ["3*popen"]}[name],
                                   option=types.SimpleNamespace(loadscopereorder=False))
    sched = scheduler(config)

    class Node:
        def __init__(self, i):
            self.gateway = types.SimpleNamespace(id=f"gw{i}")
            self.shutting_down, self.got = False, []

        def send_runtest_some(self, indexes):
            self.got += [collection[i] for i in indexes]

        def shutdown(self):
            self.shutting_down = True

    collection = [f"{HANGS}[other]", *(f"tests/test_clock.py::test_{i}" for i in range(4)), f"{HANGS}[skip]",
                  *(f"tests/test_clock.py::test_{i}" for i in range(4, 10))]
    nodes = [Node(i) for i in range(3)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    assert nodes[2].got == [f"{HANGS}[other]", f"{HANGS}[skip]"]  # gw2: beyond the 2 cores
    assert all("clock" in c for c in nodes[0].got + nodes[1].got)
    for i, nodeid in enumerate(collection):  # gw2 is done: nothing that waits is left for it
        if nodeid in nodes[2].got:
            sched.mark_test_complete(nodes[2], i)
    assert nodes[2].shutting_down and not nodes[0].shutting_down

    sched = scheduler(config)  # with nothing that computes left, the others take what waits
    nodes = [Node(i) for i in range(3)]
    for node in nodes[:2]:
        sched.add_node(node)
        sched.add_node_collection(node, collection[:1])
    sched.numnodes = 2
    sched.schedule()
    assert nodes[0].got == [f"{HANGS}[other]"]


@pytest.mark.parametrize("worker, share", [("gw0", 1.0), ("gw1", 1.0), ("gw2", 1.5)])
def test_a_waiting_worker_shares_the_cores_with_every_other_and_one_that_computes_with_none(monkeypatch, worker,
                                                                                            share):
    monkeypatch.setattr(pace, "cores", lambda: 2)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    assert pace.share() == share
