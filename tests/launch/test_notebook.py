"""``paratrain.launch`` from a Jupyter notebook, run by a real kernel (issue 27, item 2).

A function defined in a notebook cannot be pickled by reference (a new interpreter cannot import
the kernel's ``__main__``): the workers are forked from the kernel instead. The notebook is
executed with nbclient and ipykernel (optional test dependencies: the test skips without them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SETUP = """
import json, os
import torch
import paratrain

torch.set_num_threads(2)
(torch.randn(512, 512) @ torch.randn(512, 512)).sum()  # the kernel's OpenMP threads exist before the fork
"""

_TRAIN = """
class Result:  # a class of the notebook: the results travel back pickled by reference to it
    def __init__(self, **fields):
        self.__dict__.update(fields)


def train(local_rank, steps):
    torch.manual_seed(0)
    pt = paratrain.Parallel(strategy="ddp", global_batch=8)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    before = [p.detach().clone() for p in net.parameters()]
    model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = torch.Generator().manual_seed(100 + pt.rank)  # every rank its own samples
    for _ in range(steps):
        opt.zero_grad()
        pt.backward(model(torch.randn(4, 4, generator=data)).pow(2).mean())
        opt.step()
    (torch.randn(512, 512) @ torch.randn(512, 512)).sum()  # a parallel op in the forked worker
    out = Result(rank=pt.rank, world=pt.world_size, backend=pt.dist.backend, pid=os.getpid(),
                 params=[p.detach().clone() for p in net.parameters()], before=before)
    pt.close()
    return out
"""

_LAUNCH = """
results = paratrain.launch(train, nprocs=2, args=(3,), timeout=150)
print(json.dumps({
    "ranks": [(r.rank, r.world, r.backend) for r in results],
    "forked": all(r.pid != os.getpid() for r in results) and results[0].pid != results[1].pid,
    "same": all(torch.equal(a, b) for a, b in zip(results[0].params, results[1].params)),
    "trained": not all(torch.equal(a, b) for a, b in zip(results[0].params, results[0].before)),
    "lambda": paratrain.launch(lambda rank, x: rank * x, nprocs=2, args=(3,), timeout=60),
}))
"""

_ERRORS = """
def fail_on_rank_1(local_rank):
    if local_rank == 1:
        raise ValueError("boom in the notebook")


def sleep(local_rank):
    import time
    time.sleep(600)


errors = {}
for name, fn, timeout in (("failure", fail_on_rank_1, 60), ("timeout", sleep, 3)):
    try:
        paratrain.launch(fn, nprocs=2, timeout=timeout)
    except Exception as e:
        errors[name] = f"{type(e).__name__}: {e}"
torch.cuda.is_initialized = lambda: True  # what a cell that touched CUDA leaves behind
try:
    paratrain.launch(train, nprocs=2, args=(1,), timeout=60)
except Exception as e:
    errors["cuda"] = f"{type(e).__name__}: {e}"
print(json.dumps(errors))
"""


def _kernelspec(directory: Path) -> str:
    """A kernel of this interpreter (the venv the tests run in), with this checkout importable."""
    name = "paratrain-test"
    spec = directory / "kernels" / name
    spec.mkdir(parents=True)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": name, "language": "python", "env": env}))
    return name


def _printed(cell) -> dict:
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.timeout(420)
def test_launch_a_function_defined_in_a_notebook(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (requirements-common.txt)")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (requirements-common.txt)")
    if importlib.util.find_spec("ipykernel") is None:  # the kernel imports it, not this process
        pytest.skip("ipykernel is not installed (requirements-common.txt)")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    kernel = _kernelspec(tmp_path / "jupyter")
    cells = [nbformat.v4.new_code_cell(source) for source in (_SETUP, _TRAIN, _LAUNCH, _ERRORS)]
    nb = nbformat.v4.new_notebook(cells=cells)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name=kernel, startup_timeout=120,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # a cell that raises fails the test with its traceback

    launched = _printed(nb.cells[2])
    assert launched["ranks"] == [[0, 2, "gloo"], [1, 2, "gloo"]]
    assert launched["forked"] and launched["trained"]
    assert launched["same"], "DDP's ranks ended with different parameters"
    assert launched["lambda"] == [0, 3]

    errors = _printed(nb.cells[3])
    assert errors["failure"] == "LaunchError: rank 1 failed: ValueError: boom in the notebook"
    assert errors["timeout"].startswith("LaunchError: launch timed out after 3s with ranks [0, 1] still running")
    cuda = errors["cuda"]
    assert "\n" not in cuda, cuda
    assert cuda.startswith("LaunchError: CUDA has been initialised in this process before paratrain.launch: train "
                           "is defined in this notebook"), cuda
    assert "restart the kernel and call paratrain.launch before anything touches CUDA" in cuda, cuda


def test_what_runs_in_forked_workers(monkeypatch):
    """Only what refers to an interactive ``__main__`` (or cannot be pickled) is forked; a module's
    function keeps ``spawn``/``forkserver``."""
    import types

    import torch

    from paratrain.launch import notebook

    main = types.ModuleType("__main__")  # a kernel's __main__: no __file__
    exec("def fn(rank):\n    return rank\n\nclass Config:\n    pass\n", main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert notebook.interactive_main()
    assert notebook.needs_fork(main.fn, ())
    assert notebook.needs_fork(json.dumps, ({"config": main.Config()},))  # an argument of a notebook class
    assert notebook.needs_fork(lambda rank: rank, ())  # cannot be pickled at all
    assert not notebook.needs_fork(json.dumps, (torch.zeros(3), torch.nn.Linear(2, 2), {"a": [1, 2]}))
    main.__file__ = "<stdin>"  # python - <<EOF: no file a new interpreter could read
    assert notebook.interactive_main() and notebook.needs_fork(main.fn, ())
    main.__file__ = str(ROOT / "script.py")  # a script's __main__: its workers import it
    assert not notebook.interactive_main() and not notebook.needs_fork(main.fn, ())


_FROM_STDIN = """
import paratrain, torch

def work(rank):
    pt = paratrain.Parallel(strategy="ddp", global_batch=2)
    total = pt.reduce(torch.tensor(float(rank + 1)), "sum").item()
    pt.close()
    return total

print(paratrain.launch(work, nprocs=2, timeout=120))
"""


@pytest.mark.timeout(180)
def test_a_function_of_a_script_read_from_standard_input_launches():
    """``python - <<EOF``: ``__main__.__file__`` is ``<stdin>``, which a new process cannot import
    (the workers failed with ``FileNotFoundError: '<stdin>'``); they are forked, as from the REPL."""
    import subprocess

    res = subprocess.run([sys.executable, "-"], input=_FROM_STDIN, capture_output=True, text=True, timeout=150,
                         start_new_session=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[3.0, 3.0]", res.stdout
