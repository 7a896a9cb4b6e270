"""The suite's own scheduling on two workers (tests/workunits.py): what must not run beside itself
stays in one worker."""

from workunits import work_unit


def test_the_labs_tests_are_one_unit_whatever_their_module():
    assert work_unit("tests/lab/test_slurm.py::test_a") == work_unit("tests/lab/test_mpi.py::test_b[openmpi]") == "lab"


def test_a_module_with_a_module_scoped_fixture_is_one_unit_and_others_split_by_test():
    # tests/env/test_preemption.py trains its uninterrupted reference once per module
    assert work_unit("tests/env/test_preemption.py::test_x[SIGTERM]") == work_unit(
        "tests/env/test_preemption.py::test_y[SIGUSR1]") == "tests/env/test_preemption.py"
    assert work_unit("tests/test_clock.py::test_a") == "tests/test_clock.py::test_a"
    assert work_unit("tests/test_package.py::test_wheel") == "package"  # its builds write the checkout
