"""paratrain.fork/wait/fork_map: branches run concurrently, gradients equal the sequential
computation's, the caller's thread-local state applies in the branch, errors keep their type.
Timings live in benchmarks/threads.py; these tests are about behaviour."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import pytest
import torch
from torch import Tensor, nn

import paratrain
from paratrain import threads
from paratrain.threads import branches, settings

pytestmark = pytest.mark.timeout(120)  # a branch that never runs concurrently would hang the spin tests

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates TorchScript,
    warnings.simplefilter("ignore", FutureWarning)  # 2.14 with a FutureWarning

    @torch.jit.script
    def compute(x: Tensor) -> Tensor:  # the seed's example
        return x * x

    @torch.jit.script
    def spin_until_set(flag: Tensor) -> Tensor:
        while bool(flag[0] == 0):  # until the main thread sets it
            pass
        return flag * 2

    @torch.jit.script
    def fails(x: Tensor) -> Tensor:
        raise ValueError("scripted branch failed")


def test_seed_example_with_paratrain_fork():
    fut1 = paratrain.fork(compute, torch.tensor(10))
    fut2 = paratrain.fork(compute, torch.tensor(20))
    assert isinstance(fut1, torch._C.Future)  # a TorchScript fork's future (base of torch.futures.Future)
    py = paratrain.fork(lambda x: x * x, torch.tensor(3))  # a Python function: the thread pool
    assert isinstance(py, torch.futures.Future) and paratrain.wait(py).item() == 9
    assert paratrain.wait(fut1).item() == 100 and fut2.wait().item() == 400
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # torch's wait takes both once they have finished; on a running TorchScript branch it keeps
        # the GIL and hangs (paratrain.threads' docstring), so it comes after fut2.wait()
        assert torch.jit.wait(fut2).item() == 400 and torch.jit.wait(py).item() == 9
        assert paratrain.wait(torch.jit.fork(compute, torch.tensor(4))).item() == 16  # and paratrain's torch's


@pytest.mark.smoke  # also on the CUDA wheel, whose torch warns about TorchScript with a FutureWarning
def test_forking_a_scripted_function_warns_only_about_what_the_user_did():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")

        @torch.jit.script
        def cube(x: Tensor) -> Tensor:  # a fresh function: paratrain scripts a new launcher for it
            return x * x * x

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fut = paratrain.fork(cube, torch.tensor(2.0))
        assert type(fut) is torch._C.Future and paratrain.wait(fut).item() == 8
    assert [str(w.message) for w in caught] == []  # paratrain's own launcher is no deprecation of the user's


def test_eager_jit_fork_runs_in_the_caller():
    # torch's docs: "If run in pure python, fork will not execute in parallel" -- the reason paratrain
    # forks scripted functions from inside TorchScript and everything else on threads.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        fut = torch.jit.fork(threading.get_ident)
    assert fut.done() and fut.wait() == threading.get_ident()


@pytest.mark.parametrize("fn", [spin_until_set, lambda flag: spin_until_set(flag)], ids=["torchscript", "thread"])
def test_fork_returns_before_the_branch_finishes(fn):
    flag = torch.zeros(1)
    fut = paratrain.fork(fn, flag)  # a fork that ran the branch here would never return
    assert not fut.done()
    flag.fill_(1)
    assert paratrain.wait(fut).item() == 2


def test_fork_map_forms():
    xs = [torch.tensor(float(i)) for i in range(5)]
    assert [y.item() for y in paratrain.fork_map(compute, xs)] == [0, 1, 4, 9, 16]
    assert [y.item() for y in paratrain.fork_map(compute, xs, backend="threads")] == [0, 1, 4, 9, 16]
    assert [y.item() for y in paratrain.fork_map(compute, xs, backend="jit")] == [0, 1, 4, 9, 16]
    assert paratrain.fork_map([compute, lambda x: x + 1], [torch.tensor(3.0), torch.tensor(3.0)]) == [9, 4]
    assert paratrain.fork_map(str, []) == [] and paratrain.fork_map(str, [7]) == ["7"]
    with pytest.raises(ValueError, match="2 functions for 3 inputs"):
        paratrain.fork_map([str, str], [1, 2, 3])
    with pytest.raises(ValueError, match="backend 'jit' needs TorchScript functions"):
        paratrain.fork_map(lambda x: x, [torch.ones(1), torch.ones(1)], backend="jit")
    with pytest.raises(ValueError, match="backend 'fast'"):
        paratrain.fork_map(str, [1, 2], backend="fast")


def test_nested_forks_do_not_deadlock_the_pool():
    def leaf(x):
        return x + 1

    def mid(x):
        return sum(paratrain.fork_map(leaf, [x] * 4))

    def top(x):
        return sum(paratrain.fork_map(mid, [x] * 4))

    # 4 x 4 x 4 branches on a pool of torch.get_num_interop_threads() threads: a waiting branch
    # runs the branches no thread has started yet.
    assert paratrain.fork_map(top, [0, 1, 2]) == [16, 32, 48]


def test_exceptions_surface_at_wait_with_their_type():
    class Custom(KeyError):
        pass

    def bad(x):
        raise Custom(x)

    fut = paratrain.fork(bad, "branch 1")
    with pytest.raises(Custom, match="branch 1"):
        paratrain.wait(fut)
    done = []
    with pytest.raises(Custom, match="'b'"):  # the first failing branch in input order
        paratrain.fork_map(lambda x: done.append(x) if x in "ad" else bad(x), ["a", "b", "c", "d"])
    assert sorted(done) == ["a", "d"]  # the other branches finished before the raise
    with pytest.raises(ValueError, match="^scripted branch failed$") as info:  # TorchScript says builtins.ValueError
        paratrain.wait(paratrain.fork(fails, torch.ones(1)))
    assert isinstance(info.value.__cause__, RuntimeError)  # the TorchScript traceback, chained


def test_thread_local_state_is_carried_into_branches():
    x = torch.ones(2, 2, requires_grad=True)
    for backend in ("threads", "sequential"):
        probe = lambda _: (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),  # noqa: E731
                           torch.is_autocast_enabled("cpu"), (x @ x).dtype, (x @ x).requires_grad)
        assert paratrain.fork_map(probe, [0, 1], backend=backend)[1] == (True, False, False, torch.float32, True)
        with torch.no_grad():
            assert paratrain.fork_map(probe, [0, 1], backend=backend)[1] == (False, False, False, torch.float32, False)
        with torch.inference_mode():
            assert paratrain.fork_map(probe, [0, 1], backend=backend)[1][:2] == (False, True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert paratrain.fork_map(probe, [0, 1], backend=backend)[1][2:4] == (True, torch.bfloat16)
    # The pool's threads compute with torch's intra-op setting, as the caller does.
    assert paratrain.wait(paratrain.fork(torch.get_num_threads)) == torch.get_num_threads()


def tower(seed: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


class TwoTower(nn.Module):
    def __init__(self, dtype: torch.dtype, backend: str) -> None:
        super().__init__()
        self.towers = nn.ModuleList([tower(1, dtype), tower(2, dtype)])
        self.head = nn.Linear(6, 2).to(dtype)
        self.backend = backend

    def forward(self, x: Tensor) -> Tensor:
        a, b = paratrain.fork_map(self.towers, [x, x * 2], backend=self.backend)
        return self.head(torch.cat([a, b], dim=1))


def grads(model: nn.Module, x: Tensor) -> list[Tensor]:
    x = x.clone().requires_grad_()
    model.zero_grad()
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradients_equal_the_sequential_computation(dtype):
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = grads(TwoTower(dtype, "sequential"), x)
    for backend in ("threads", "auto"):
        got = grads(TwoTower(dtype, backend), x)
        for g, e in zip(got, expected):
            if dtype == torch.float64:
                assert torch.equal(g, e)  # two branches: each gradient is the same sum
            else:
                torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def test_shared_weights_over_many_branches():
    # One module on 4 inputs: its weight's gradient adds 4 branch contributions, in whatever order
    # the branches' nodes come in backward: equal up to rounding.
    net = tower(3, torch.float64)
    xs = [torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    sequential = torch.autograd.grad(sum(y.sum() for y in paratrain.fork_map(net, xs, backend="sequential")),
                                     list(net.parameters()))
    forked = torch.autograd.grad(sum(y.sum() for y in paratrain.fork_map(net, xs)), list(net.parameters()))
    for f, s in zip(forked, sequential):
        torch.testing.assert_close(f, s, rtol=1e-12, atol=1e-14)


def test_scripted_modules_fork_on_the_interop_pool_with_autograd():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        towers = [torch.jit.script(tower(i, torch.float64)) for i in (4, 5)]
    x = torch.randn(4, 6, dtype=torch.float64)
    fut = paratrain.fork(towers[1], x)
    assert type(fut) is torch._C.Future  # the scripted launcher, not the thread pool
    paratrain.wait(fut)
    params = list(towers[1].parameters())
    for _ in range(3):  # TorchScript profiles the first calls, then runs an optimised plan (its own backward)
        g_seq = torch.autograd.grad(towers[1](x).sum(), params)
        outs = paratrain.fork_map(towers, [x, x], backend="jit")
        g_forked = torch.autograd.grad(sum(o.sum() for o in outs), params)
    assert all(torch.equal(a, b) for a, b in zip(g_forked, g_seq))  # forked == called directly
    towers[1].eval()  # the launcher calls the user's module itself: its mode is the user's
    assert not towers[1]._paratrain_launchers[1].fn.training
    gone = weakref.ref(towers.pop())
    del fut, outs
    gc.collect()
    assert gone() is None  # its launcher does not keep a forked module alive


def test_torch_compile_graph_breaks_at_fork_map():
    torch._dynamo.reset()
    model = TwoTower(torch.float32, "auto")
    x = torch.randn(4, 6)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count >= 1  # fork_map is excluded from compilation (torch.compiler.disable)
    compiled = torch.compile(model, backend="eager")
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    g = grads(compiled, x)
    assert all(torch.equal(a, b) for a, b in zip(g, grads(model, x)))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="compile the branch functions and fork those"):
        torch.compile(model, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    # What compiles: the branches themselves, forked.
    towers = [torch.compile(t, backend="eager") for t in model.towers]
    for got, want in zip(paratrain.fork_map(towers, [x, x]), [t(x) for t in model.towers]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch._dynamo.reset()


def test_configure_threads(monkeypatch, capsys):
    before = torch.get_num_threads()
    monkeypatch.setattr(settings, "_printed", False)
    monkeypatch.setattr(settings, "usable_cores", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    set_inter = []
    monkeypatch.setattr(torch, "set_num_interop_threads", set_inter.append)
    monkeypatch.setattr(torch, "get_num_interop_threads", lambda: set_inter[-1] if set_inter else 16)
    try:
        s = threads.configure_threads(4)  # 16 cores / 4 processes: 4 intra-op threads, inter-op 1
        assert (s.intra_op, s.inter_op, s.inter_op_kept) == (4, 1, False) and torch.get_num_threads() == 4
        assert "4 intra-op" in capsys.readouterr().err
        s = threads.configure_threads(4, branches=2)  # two branches at once: 2 threads each
        assert (s.intra_op, s.inter_op) == (2, 2) and capsys.readouterr().err == ""  # said once
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the launcher's choice wins
        s = threads.configure_threads()
        assert (s.local_world_size, s.intra_op, s.inter_op) == (2, 3, 2)

        def refuse(n):
            raise RuntimeError("Error: cannot set number of interop threads after parallel work has started")

        monkeypatch.setattr(torch, "set_num_interop_threads", refuse)
        monkeypatch.delenv("OMP_NUM_THREADS")
        s = threads.configure_threads(16)  # wants inter-op 1, keeps the 2 already set
        assert (s.intra_op, s.inter_op, s.inter_op_kept) == (1, 2, True) and "kept" in s.line()
        with pytest.raises(ValueError, match="must be at least 1"):
            threads.configure_threads(0)
    finally:
        torch.set_num_threads(before)
        branches._reset_pool()


@pytest.mark.parametrize("script, argv, expect", [
    ("examples/fork_seed.py", [], ["seed:       tensor(100) tensor(400)", "paratrain:  tensor(100) tensor(400)",
                                   "torch.jit.fork from Python ran in the caller: True",
                                   "paratrain.fork ran in another thread:        True"]),
    ("examples/fork_towers.py", ["--steps", "3", "--tokens", "64", "--hidden", "64", "--d", "32", "--experts", "3"],
     ["sequential: loss", "fork_map  : loss", "largest weight difference between the two runs"]),
])
def test_examples_run(script, argv, expect, monkeypatch, capsys):
    import os
    import runpy

    threads_before = torch.get_num_threads()
    monkeypatch.setattr("sys.argv", [script, *argv])
    try:
        runpy.run_path(os.path.join(os.path.dirname(__file__), "..", script), run_name="__main__")
    finally:
        torch.set_num_threads(threads_before)
    out = capsys.readouterr().out
    for line in expect:
        assert line in out, out
    if "fork_towers" in script:  # same weights whether the experts ran at once or one after another
        diff = float(out.rsplit("runs: ", 1)[1].split()[0])
        assert diff < 1e-5, out


class _Meet:
    """Two branches that each say they started and wait (briefly) for the other: they both see the
    other only if they ran at the same time, however loaded the machine."""

    def __init__(self, timeout: float) -> None:
        self.started, self.met, self.timeout = [threading.Event(), threading.Event()], [False, False], timeout

    def arrive(self, i: int) -> None:
        self.started[i].set()
        self.met[i] = self.started[1 - i].wait(self.timeout)


class _Rendezvous(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, meet, i):
        ctx.meet, ctx.i = meet, i
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.meet.arrive(ctx.i)
        return g, None, None


def test_what_backward_overlaps_on_the_cpu():
    # One backward() over two branches runs their nodes one at a time in the calling thread ...
    w = torch.ones(3, requires_grad=True)
    meet = _Meet(timeout=0.3)
    (_Rendezvous.apply(w * 2, meet, 0).sum() + _Rendezvous.apply(w * 3, meet, 1).sum()).backward()
    assert sorted(meet.met) == [False, True]  # the first waited in vain; the second found it had run
    # ... while autograd.grad calls in separate threads run at once (what devices' pipelined backward uses).
    meet = _Meet(timeout=60)
    outs = [_Rendezvous.apply(w * 2, meet, 0), _Rendezvous.apply(w * 3, meet, 1)]
    grads = paratrain.fork_map(lambda t: torch.autograd.grad(t.sum(), w)[0], outs)
    assert meet.met == [True, True] and [g.tolist() for g in grads] == [[2.0] * 3, [3.0] * 3]


def test_python_branches_meet_on_threads_but_not_with_eager_jit_fork():
    meet = _Meet(timeout=60)
    fut = paratrain.fork(meet.arrive, 0)
    meet.arrive(1)
    paratrain.wait(fut)
    assert meet.met == [True, True]
    meet = _Meet(timeout=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        fut = torch.jit.fork(meet.arrive, 0)  # runs here, to the end, before returning
    meet.arrive(1)
    assert meet.met == [False, True]
