"""What each strategy can run is asked of its class (never of its name), before any process starts."""

from __future__ import annotations

import ast
import pathlib

import pytest

from clitools import run_cli
from paratrain import strategies
from paratrain.config import ParallelConfig


@pytest.mark.parametrize("name, world, options, expected", [
    ("ddp", 4, None, 4),
    ("fsdp", 4, None, 4),
    ("ps", 3, None, 3),
    ("tensor", 4, strategies.TensorOptions(tp_size=2), 2),  # a tp group reads one batch
    ("tensor", 4, strategies.TensorOptions(), 1),           # tp over the whole world
    ("pipeline", 4, None, 1),                               # one replica
])
def test_data_parallel_size_for(name: str, world: int, options: object, expected: int) -> None:
    assert strategies.resolve(name).data_parallel_size_for(world, options) == expected


@pytest.mark.parametrize("name", [n for n, cls in strategies.STRATEGIES.items() if cls.processes == "one"])
def test_one_process_strategies_refuse_a_bigger_world(name: str) -> None:
    strategies.resolve(name).check_world(1)
    with pytest.raises(ValueError, match=f"strategy '{name}' runs in one process, but 2 were asked for"):
        strategies.resolve(name).check_world(2)


@pytest.mark.parametrize("strategy, precision, needle", [
    ("fsdp", "bf16-true", "use bf16-mixed (FSDP2 already keeps fp32 sharded master weights"),
    ("tensor", "fp16-true", "use bf16-mixed (FSDP2"),
    ("pipeline", "bf16-true", "not supported with strategy pipeline: use bf16-mixed or 32"),
    ("ps", "fp16-mixed", "each rank would skip overflowing steps on its own"),
    ("pipeline", "fp16-mixed", "each rank would skip overflowing steps on its own"),
])
def test_precision_support_is_the_strategys_fact(strategy: str, precision: str, needle: str) -> None:
    with pytest.raises(ValueError, match=".*") as e:
        ParallelConfig(strategy=strategy, precision=precision)
    assert needle in str(e.value)


@pytest.mark.parametrize("strategy", ["single", "dp", "ddp", "devices"])
def test_master_weights_are_accepted_where_supported(strategy: str) -> None:
    ParallelConfig(strategy=strategy, precision="bf16-true")


def test_devices_on_two_processes_is_refused_before_workers_start() -> None:
    """It used to start two workers that each died."""
    res = run_cli(["train", "--strategy", "devices", "--nproc-per-node", "2", "--no-progress", "--log-dir", "none"],
                  timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "strategy 'devices' runs in one process, but 2 were asked for" in lines[0], res.stderr


# --- issue 11: bench and verify ask these facts, never a name ------------------------------------------------------

# The facts table: one row per registered strategy, in registry order (adding a strategy adds its row here).
FACTS = [  # name, processes, drives all local devices, reference, plain data parallel, comm hooks, bench, options
    ("single", "one", False, True, False, False, "quick", False),
    ("dp", "one", True, False, False, False, "quick", False),
    ("ddp", "any", False, False, True, True, "quick", True),
    ("fsdp", "any", False, False, False, False, "quick", True),
    ("tensor", "any", False, False, False, False, "full", True),
    ("pipeline", "any", False, False, False, False, "full", True),
    ("devices", "one", False, False, False, False, "full", True),
    ("ps", "any", False, False, False, False, "full", True),
    ("mesh", "any", False, False, False, False, "no", True),
]


@pytest.mark.parametrize("name, processes, all_devices, reference, plain, hooks, bench, options", FACTS)
def test_capabilities_per_strategy(name: str, processes: str, all_devices: bool, reference: bool, plain: bool,
                                   hooks: bool, bench: str, options: bool) -> None:
    cls = strategies.resolve(name)
    assert cls.processes == processes
    assert cls.drives_all_local_devices is all_devices
    assert cls.reference is reference
    assert cls.plain_data_parallel is plain
    assert bool(cls.comm_hooks) is hooks
    assert cls.bench_default == bench
    assert (cls.options_class is not None) is options
    if options:  # its [parallel.<name>] section comes from the registry, with its defaults
        assert isinstance(getattr(ParallelConfig(), name), cls.options_class)


def test_every_registered_strategy_has_a_row_above() -> None:
    """A new strategy must state its facts (add it to the table above), in registry order."""
    assert list(strategies.STRATEGIES) == [row[0] for row in FACTS]


def test_registry_names_the_strategy_declaring_a_fact() -> None:
    from paratrain.strategies.ddp import COMM_HOOKS

    assert strategies.reference() == "single" == ParallelConfig().for_world(1).strategy
    assert strategies.data_parallel_reference() == "ddp" == ParallelConfig().for_world(2).strategy
    assert strategies.resolve("ddp").comm_hooks == COMM_HOOKS
    assert strategies.bench_defaults() == [row[0] for row in FACTS if row[6] in ("quick", "full")]
    assert strategies.bench_defaults(quick=True) == [row[0] for row in FACTS if row[6] == "quick"]


def test_what_lists_the_strategies_comes_from_the_registry() -> None:
    """Issue 25: adding a strategy touches its file, its test, one registry row and one facts row; the
    rest lists the registry. The smoke suite trains every registered strategy (tests/test_smoke.py,
    run on the CUDA wheel), ``paratrain train --strategy``'s help names each one, and the config has
    a section for each one with options."""
    import dataclasses
    import importlib.util

    from paratrain.cli.train import _FLAGS

    spec = importlib.util.spec_from_file_location("smoke_table", pathlib.Path(__file__).parents[1] / "test_smoke.py")
    smoke = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(smoke)  # type: ignore[union-attr]
    assert set(smoke.STRATEGIES) == set(strategies.STRATEGIES)
    assert all(smoke.STRATEGIES[n] == (1 if cls.processes == "one" else 2) for n, cls in strategies.STRATEGIES.items())
    helped = _FLAGS["--strategy"][2]
    assert all(name in helped.replace(" or ", ", ").split(", ") for name in strategies.STRATEGIES), helped
    sections = {f.name for f in dataclasses.fields(ParallelConfig)}
    assert {n for n, cls in strategies.STRATEGIES.items() if cls.options_class} <= sections


def test_hidden_comm_bytes_are_zero_where_everything_goes_through_python_collectives() -> None:
    import torch
    from torch import nn

    from paratrain.env.base import ProcessInfo
    from paratrain.env.process import Dist

    model = nn.Linear(3, 2)
    one = Dist(ProcessInfo(), torch.device("cpu"), None)
    assert strategies.resolve("single")(one).hidden_comm_bytes_per_step(model) == 0
    assert strategies.DDPStrategy(one).hidden_comm_bytes_per_step(model) == 0  # world 1: no all-reduce at all
    two = Dist(ProcessInfo(world_size=2), torch.device("cpu"), "gloo")
    hooked = strategies.DDPStrategy(two, options=strategies.DDPOptions(comm_hook="fp16"))
    assert hooked.hidden_comm_bytes_per_step(model) == 0  # the hook's all-reduce is a Python call: counted
    assert strategies.ParameterServerStrategy(two).hidden_comm_bytes_per_step(model) == 0  # before setup: nothing


def name_comparisons(root: pathlib.Path) -> list[str]:
    """``file:line`` of every place under ``root/paratrain`` (outside ``strategies/``) that compares a
    strategy name (``== "ddp"``, ``in ("dp", ...)``), lists two or more names, or picks a strategy by
    a literal name (``strategy="ddp"``, ``{"parallel.strategy": "single"}``)."""
    names = set(strategies.STRATEGIES)
    base = root / "paratrain"

    def is_name(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    def holds_name(node: ast.AST) -> bool:
        return is_name(node) or (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(is_name, node.elts)))

    found: list[tuple[str, int]] = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base.parent).as_posix()
        if rel.startswith("paratrain/strategies/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            hit = False
            if isinstance(node, ast.Compare):
                hit = any(map(holds_name, [node.left, *node.comparators]))
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                hit = sum(map(is_name, node.elts)) >= 2
            elif isinstance(node, ast.keyword):
                hit = node.arg == "strategy" and is_name(node.value)
            elif isinstance(node, ast.Dict):
                hit = any(isinstance(k, ast.Constant) and k.value == "parallel.strategy" and is_name(v)
                          for k, v in zip(node.keys, node.values))
            if hit:
                found.append((rel, getattr(node, "lineno", 0)))
    return [f"{rel}:{line}" for rel, line in sorted(found)]


def test_no_strategy_name_is_compared_outside_the_strategies() -> None:
    """Issue 11: ask the class for a capability (``strategy_class.processes == "one"``), never its name."""
    assert name_comparisons(pathlib.Path(__file__).resolve().parents[2]) == []


def test_the_name_scan_finds_what_it_looks_for(tmp_path: pathlib.Path) -> None:
    (tmp_path / "paratrain" / "strategies").mkdir(parents=True)
    (tmp_path / "paratrain" / "strategies" / "x.py").write_text('ok = name == "ddp"\n')  # the registry may
    (tmp_path / "paratrain" / "m.py").write_text(
        'a = s == "ddp"\n'
        'b = s not in ("dp", "x")\n'
        'C = ("single", "dp")\n'
        'd = f(strategy="fsdp")\n'
        'e = {"parallel.strategy": "single"}\n'
        'f = g(a, 0, "tensor")\n'  # a name-like string that picks no strategy
        'h = s == SERVER\n')
    assert name_comparisons(tmp_path) == ["paratrain/m.py:1", "paratrain/m.py:2", "paratrain/m.py:3",
                                          "paratrain/m.py:4", "paratrain/m.py:5"]


# --- issue 25: a precision is asked for its facts, never compared by name or class ----------------------------------

def precision_sites(root: pathlib.Path) -> list[str]:
    """``file:line`` of every place under ``root/paratrain`` (outside ``precision/``) that decides by a
    precision's name or class: compares a name (``== "fp16-mixed"``, ``in ("bf16-true", ...)``), lists two
    or more, maps names to something (a name -> dtype table), defaults a ``precision`` to a literal name,
    passes one as ``precision=``, checks ``isinstance``/``issubclass`` against a precision class, or
    reads the name tables (``MASTER_WEIGHTS``, ``PRECISIONS[...]``) instead of ``precision.lookup``.
    DDP's comm hooks ``fp16``/``bf16`` share two aliases' spelling: those two are not precision names here."""
    from paratrain import precision
    from paratrain.strategies.ddp import COMM_HOOKS

    names = (set(precision.PRECISIONS) | set(precision.ALIASES)) - set(COMM_HOOKS)
    classes = {c.__name__ for c in precision.PRECISIONS.values()} | {"MasterWeights"}
    base = root / "paratrain"

    def is_name(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    def holds_name(node: ast.AST) -> bool:
        return is_name(node) or (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(is_name, node.elts)))

    def names_class(node: ast.AST) -> bool:
        if isinstance(node, (ast.Tuple, ast.List)):
            return any(map(names_class, node.elts))
        return (isinstance(node, ast.Name) and node.id in classes) or (isinstance(node, ast.Attribute) and node.attr in classes)

    def table(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("PRECISIONS", "ALIASES")) or \
            (isinstance(node, ast.Attribute) and node.attr in ("PRECISIONS", "ALIASES"))

    found: list[tuple[str, int]] = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base.parent).as_posix()
        if rel.startswith("paratrain/precision/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            hit = False
            if isinstance(node, ast.Compare):
                hit = any(map(holds_name, [node.left, *node.comparators]))
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                hit = sum(map(is_name, node.elts)) >= 2
            elif isinstance(node, ast.Dict):
                hit = any(map(is_name, node.keys)) or any(
                    isinstance(k, ast.Constant) and str(k.value).endswith("precision") and is_name(v)
                    for k, v in zip(node.keys, node.values))
            elif isinstance(node, ast.keyword):
                hit = "precision" in (node.arg or "") and is_name(node.value)
            elif isinstance(node, ast.AnnAssign):
                hit = isinstance(node.target, ast.Name) and "precision" in node.target.id and is_name(node.value)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                positional = [*args.posonlyargs, *args.args]
                pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
                         *zip(args.kwonlyargs, args.kw_defaults)]
                hit = any("precision" in a.arg and is_name(d) for a, d in pairs)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2:
                hit = node.func.id in ("isinstance", "issubclass") and names_class(node.args[1])
            elif isinstance(node, ast.Subscript):
                hit = table(node.value)
            elif isinstance(node, ast.Attribute):
                hit = node.attr == "MASTER_WEIGHTS" or (node.attr == "get" and table(node.value))
            elif isinstance(node, ast.Name):
                hit = node.id == "MASTER_WEIGHTS"
            if hit:
                found.append((rel, getattr(node, "lineno", 0)))
    return [f"{rel}:{line}" for rel, line in sorted(set(found))]


def test_no_precision_name_or_class_decides_outside_precision() -> None:
    """Issue 25: ask the precision (``precision.lookup(name).scales_loss``, ``strategy.precision.param_dtype``)."""
    assert precision_sites(pathlib.Path(__file__).resolve().parents[2]) == []


def test_the_precision_scan_finds_what_it_looks_for(tmp_path: pathlib.Path) -> None:
    (tmp_path / "paratrain" / "precision").mkdir(parents=True)
    (tmp_path / "paratrain" / "precision" / "x.py").write_text('ok = name == "fp16-mixed"\n')  # the registry may
    (tmp_path / "paratrain" / "m.py").write_text(
        'a = p == "fp16-mixed"\n'
        'b = p not in ("bf16-true", "x")\n'
        'C = ("32", "tf32")\n'
        'd = {"bf16-mixed": 1}.get(p)\n'
        'e = f(precision="bf16-true")\n'
        'def g(precision: str = "32"): ...\n'
        'h = isinstance(p, (FP16Mixed, MasterWeights))\n'
        'i = PRECISIONS.get(p)\n'
        'j = p in MASTER_WEIGHTS\n'
        'k = hook == "fp16"\n'  # DDP's comm hook, not a precision
        'm = lookup(p).scales_loss\n')
    assert precision_sites(tmp_path) == [f"paratrain/m.py:{n}" for n in range(1, 10)]


def test_a_model_wrapped_by_the_user_is_kept_by_ddp_and_refused_elsewhere():
    import pytest
    import torch
    from torch import nn

    import paratrain

    pt = paratrain.Parallel(strategy="single", global_batch=2)
    with pytest.raises(ValueError, match="already wrapped in DataParallel: pass the plain module"):
        pt.setup(nn.DataParallel(nn.Linear(2, 2)))
    pt.close()
    assert paratrain.strategies.STRATEGIES["ddp"].adopt.__doc__  # ddp keeps the user's own DDP (examples/seed000_after.py)
    assert torch is not None
