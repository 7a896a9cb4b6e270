"""The GPU-only checks of ``scripts/device_check.sh``, each a short paratrain run compared with a
one-process reference; ``python scripts/device_checks NAME --mode gpu|cpu --result FILE``.

``--mode gpu`` is the check as a GPU machine runs it (CUDA, nccl); ``--mode cpu`` is its CPU twin at
tiny size, what ``device_check.sh --dry-run`` runs (gloo, the CPU's autocast, paratrain's own
SyncBatchNorm, torch.compile with the ``aot_eager`` backend). A check returns a :class:`Result`;
one that raises :class:`CheckFailed` (or anything else) failed, :class:`Skip` skipped with its
reason. Every check prints what it compared, so its log in ``OUT/<check>.log`` shows the numbers.

The driver (``scripts/device_check.py``) imports nothing from here: it runs each check in a process
of its own, with a hard time limit.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CheckFailed(Exception):
    """A check ran and found a wrong result (the message is its one-line reason)."""


class Skip(Exception):
    """A check cannot run here (the message says why: no CUDA, a package missing...)."""


@dataclass
class Result:
    summary: str
    """One line: what was compared and how close it came."""
    details: dict[str, Any] = field(default_factory=dict)


CHECKS: dict[str, Callable[[str, float], Result]] = {}


def check(fn: Callable[[str, float], Result]) -> Callable[[str, float], Result]:
    CHECKS[fn.__name__] = fn
    return fn


# --------------------------------------------------------------------------- helpers


def _device(mode: str) -> Any:
    import torch

    if mode == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Skip(f"no CUDA: torch {torch.__version__} sees no GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # the references compare in true fp32
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", 0)


def _rel(a: Any, b: Any) -> float:
    """Relative difference of two tensors (max |a-b| / max |b|), in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _state_rel(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, str]:
    """The largest relative difference over the floating tensors of two state dicts, and its key."""
    worst, where = 0.0, next(iter(want), "")
    for k, v in want.items():
        if not getattr(v, "is_floating_point", lambda: False)():
            continue
        if k not in got:
            raise CheckFailed(f"state key {k!r} missing (got {sorted(got)[:6]}...)")
        r = _rel(got[k], v)
        if r > worst or r != r:  # NaN counts as the worst
            worst, where = r, k
    return worst, where


def _mlp(features: int = 64, hidden: int = 128, classes: int = 10) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def _bn_cnn(classes: int = 10) -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, classes))


def _batches(steps: int, batch: int, shape: tuple[int, ...], classes: int = 10, seed: int = 0) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn((batch, *shape), generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(steps)]


def _plain_sgd(model: Any, batches: list[Any], device: Any, lr: float = 0.05) -> list[float]:
    """The reference: a plain fp32 PyTorch loop, one SGD step per batch; the losses."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _run(args: list[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    """``python ARGS`` from the checkout (its output echoed into this check's log); a failure is
    :class:`CheckFailed` with the command's last line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    print(f"$ {' '.join(args)}", flush=True)
    t0 = time.monotonic()
    try:
        res = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise CheckFailed(f"{what} ran past {timeout:.0f} s") from e
    print(res.stdout[-4000:], res.stderr[-4000:], f"({time.monotonic() - t0:.1f} s, exit {res.returncode})",
          sep="\n", flush=True)
    if res.returncode != 0:
        last = (res.stderr.strip() or res.stdout.strip() or "no output").splitlines()[-1]
        raise CheckFailed(f"{what} exited with {res.returncode}: {last[:300]}")
    return res


# --------------------------------------------------------------------------- nccl


@check
def nccl(mode: str, budget: float) -> Result:
    """nccl at world size 1 (gloo on the CPU): the collectives paratrain uses, paratrain's
    ``all_gather``/``reduce``, and DDP on the group, against a plain loop."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.env.network import free_port
    from paratrain.env.process import select_backend
    from paratrain.metrics import all_gather, reduce

    device = _device(mode)
    backend = "nccl" if mode == "gpu" else "gloo"
    if mode == "gpu":
        if not dist.is_nccl_available():
            raise CheckFailed(f"torch {torch.__version__} has no nccl backend")
        if select_backend(device) != "nccl":
            raise CheckFailed(f"paratrain picks backend {select_backend(device)!r} for {device}, not nccl")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        x = torch.arange(1.0, 9.0, device=device)
        t = x.clone()
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        gathered = [torch.empty_like(t)]
        dist.all_gather(gathered, t)
        if mode == "gpu":  # gloo has neither of these
            flat = torch.empty_like(t)
            dist.all_gather_into_tensor(flat, t)
            rs = torch.empty_like(t)
            dist.reduce_scatter_tensor(rs, t)
            gathered += [flat, rs]
        dist.barrier()
        for got in (t, *gathered):
            if not torch.equal(got, x):
                raise CheckFailed(f"a {backend} collective at world size 1 changed its tensor: {got.tolist()}")
        if not torch.equal(all_gather(x), x) or float(reduce(x.sum(), "mean", device=device)) != float(x.sum()):
            raise CheckFailed("paratrain's all_gather/reduce at world size 1 changed the value")
        nccl_version = None
        if mode == "gpu":
            v = torch.cuda.nccl.version()
            nccl_version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)

        batches = _batches(8, 32, (64,))
        torch.manual_seed(1)
        ref = _mlp().to(device)
        ddp_model = DDP(copy.deepcopy(ref), device_ids=[0] if device.type == "cuda" else None)
        ref_losses = _plain_sgd(ref, batches, device)
        ddp_losses = _plain_sgd(ddp_model, batches, device)
        err, key = _state_rel(ddp_model.module.state_dict(), ref.state_dict())
        print(f"losses plain {ref_losses[-1]:.6f}, ddp {ddp_losses[-1]:.6f}; worst parameter {key}: {err:.2e}")
        if not err <= 1e-6:
            raise CheckFailed(f"DDP over {backend} at world size 1 drifts from the plain loop: {key} {err:.2e} > 1e-6")
    finally:
        dist.destroy_process_group()
    return Result(f"{backend} at world size 1: collectives exact, DDP = plain loop after 8 steps (rel. {err:.1e})"
                  + (f"; NCCL {nccl_version}" if nccl_version else ""),
                  {"backend": backend, "nccl": nccl_version, "ddp_rel_err": err})


# --------------------------------------------------------------------------- fsdp + bf16


@check
def fsdp_bf16(mode: str, budget: float) -> Result:
    """``paratrain train --strategy fsdp --precision bf16-mixed`` against ``--strategy single`` at
    the same precision (on the GPU at world size 1 over nccl; on the CPU at world size 2 over gloo),
    and fsdp with ``cpu_offload`` (parameters, gradients and optimizer state in host memory: FSDP2's
    ``CPUOffloadPolicy``) against fsdp without it, on the GPU (on the CPU it is a no-op, not run)."""
    _device(mode)
    import tempfile

    steps, nproc, model = ("30", "1", "cnn") if mode == "gpu" else ("8", "2", "mlp")
    job = ["-m", "paratrain", "train", "--model", model, "--precision", "bf16-mixed", "--max-steps", steps,
           "--no-progress"]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="device-check-fsdp-") as tmp:
        for name, extra in (("single", ["--strategy", "single"]),
                            ("fsdp", ["--strategy", "fsdp", "--nproc-per-node", nproc]),
                            ("offload", ["--strategy", "fsdp", "--nproc-per-node", nproc,
                                         "--set", "parallel.fsdp.cpu_offload=true"])):
            if name == "offload" and mode == "cpu":  # a no-op on the CPU (the states are in host memory): not run
                runs[name] = runs["fsdp"]
                continue
            d = os.path.join(tmp, name)
            _run([*job, *extra, "--log-dir", d], budget / (3 if mode == "gpu" else 2), f"train {' '.join(extra)}")
            with open(os.path.join(d, "result.json")) as f:
                runs[name] = json.load(f)
    single, fsdp, offload = runs["single"], runs["fsdp"], runs["offload"]
    if fsdp["world_size"] != int(nproc) or fsdp["steps"] != int(steps):
        raise CheckFailed(f"fsdp ran {fsdp['steps']} steps at world size {fsdp['world_size']}, not {steps} at {nproc}")
    device = fsdp["provenance"]["world"]["device"]
    if mode == "gpu" and not str(device).startswith("cuda"):
        raise CheckFailed(f"fsdp ran on {device}, not on the GPU")
    loss_err = abs(fsdp["test_loss"] - single["test_loss"]) / abs(single["test_loss"])
    acc_diff = abs(fsdp["test_accuracy"] - single["test_accuracy"])
    line = (f"after {steps} steps: test loss fsdp {fsdp['test_loss']:.4f} vs single {single['test_loss']:.4f} "
            f"(rel. {loss_err:.1e}), accuracy {fsdp['test_accuracy']:.2%} vs {single['test_accuracy']:.2%}")
    print(line)
    if not (loss_err <= 0.05 and acc_diff <= 0.05):  # fsdp computes in bf16 weights, single under autocast
        raise CheckFailed(f"fsdp bf16-mixed x{nproc} is not single's result: {line}")
    offload_err = abs(offload["test_loss"] - fsdp["test_loss"]) / abs(fsdp["test_loss"])
    offload_line = f"cpu_offload test loss {offload['test_loss']:.4f} (rel. {offload_err:.1e} to fsdp)"
    print(offload_line)
    if not offload_err <= 1e-2:  # the same bf16 computation; only where the states live differs
        raise CheckFailed(f"fsdp cpu_offload x{nproc} is not fsdp's result: {offload_line}")
    return Result(f"fsdp bf16-mixed x{nproc} on {device} = single bf16-mixed: {line}; {offload_line}",
                  {"device": device, "world_size": int(nproc), "test_loss": fsdp["test_loss"],
                   "single_test_loss": single["test_loss"], "rel_err": loss_err,
                   "cpu_offload_test_loss": offload["test_loss"], "cpu_offload_rel_err": offload_err})


# --------------------------------------------------------------------------- fp16-mixed + GradScaler


@check
def fp16_scaler(mode: str, budget: float) -> Result:
    """A Parallel loop in fp16-mixed: its scaler is torch.amp's GradScaler for the device, training
    follows the fp32 loop, and an inf loss skips the step, keeps the weights and halves the scale."""
    import torch
    import torch.nn.functional as F

    import paratrain

    device = _device(mode)
    batches = _batches(12, 32, (64,))
    torch.manual_seed(1)
    ref = _mlp().to(device)
    model = copy.deepcopy(ref)
    ref_losses = _plain_sgd(ref, batches, device)

    pt = paratrain.Parallel(strategy="single", precision="fp16-mixed", global_batch=32,
                            accelerator="cuda" if mode == "gpu" else "cpu")
    scaler = getattr(pt.precision, "scaler", None)
    if not isinstance(scaler, torch.amp.GradScaler):
        raise CheckFailed(f"fp16-mixed's scaler is {type(scaler).__name__}, not torch.amp.GradScaler")
    scaler_device = getattr(scaler, "_device", None)
    if scaler_device != device.type:
        raise CheckFailed(f"fp16-mixed's GradScaler is for {scaler_device!r}, not {device.type!r}")
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(pt.device)), y.to(pt.device))
        pt.backward(loss)
        opt.step()
        losses.append(float(loss.detach()))
    err, key = _state_rel(pt.unwrap(model).state_dict(), ref.state_dict())
    print(f"final loss fp16-mixed {losses[-1]:.5f} vs fp32 {ref_losses[-1]:.5f}; worst parameter {key}: {err:.2e}; "
          f"scale {pt.precision.loss_scale}")
    if not err <= 2e-2:
        raise CheckFailed(f"fp16-mixed drifts from the fp32 loop after {len(batches)} steps: {key} {err:.2e} > 2e-2")
    if pt.skipped_steps:
        raise CheckFailed(f"fp16-mixed skipped {pt.skipped_steps} of {len(batches)} ordinary steps")

    before = {k: v.clone() for k, v in pt.unwrap(model).state_dict().items()}
    scale = pt.precision.loss_scale
    x, y = batches[0]
    opt.zero_grad()
    pt.backward(F.cross_entropy(model(x.to(pt.device)), y.to(pt.device)) * float("inf"))
    opt.step()
    after = pt.unwrap(model).state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    print(f"inf loss: skipped steps {pt.skipped_steps}, scale {scale} -> {pt.precision.loss_scale}, moved {moved}")
    if pt.skipped_steps != 1 or moved or not pt.precision.loss_scale < scale:
        raise CheckFailed(f"an inf loss was not skipped: skipped_steps {pt.skipped_steps}, parameters moved {moved}, "
                          f"scale {scale} -> {pt.precision.loss_scale}")
    pt.close()
    return Result(f"torch.amp.GradScaler('{device.type}'); 12 steps within {err:.1e} of fp32; an inf step skipped, "
                  f"scale {scale:g} -> {pt.precision.loss_scale:g}",
                  {"rel_err": err, "scaler_device": scaler_device})


# --------------------------------------------------------------------------- SyncBatchNorm


def _syncbn_worker(rank: int, mode: str, batches: list[Any], init: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import paratrain

    pt = paratrain.Parallel(strategy="ddp", sync_batchnorm=True, backend="gloo", global_batch=len(batches[0][0]),
                            accelerator="cuda" if mode == "gpu" else "cpu")
    model = _bn_cnn()
    model.load_state_dict(init)
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    kinds = sorted({f"{type(m).__module__}.{type(m).__name__}" for m in pt.unwrap(model).modules()
                    if "BatchNorm" in type(m).__name__})
    share = len(batches[0][0]) // pt.world_size
    for x, y in batches:  # this rank's contiguous share of each global batch
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        opt.zero_grad()
        pt.backward(F.cross_entropy(model(x.to(pt.device)), y.to(pt.device)))
        opt.step()
    state = {k: v.detach().cpu() for k, v in pt.unwrap(model).state_dict().items()}
    out = {"kinds": kinds, "device": str(pt.device), "backend": pt.dist.backend, "state": state}
    pt.close()
    return out


@check
def syncbn(mode: str, budget: float) -> Result:
    """``sync_batchnorm=True`` under ddp at world size 2 (both ranks on GPU 0, over gloo, which takes
    CUDA tensors): the layers become ``torch.nn.SyncBatchNorm`` (paratrain's own on the CPU), and 5
    steps equal one process with plain BatchNorm over the whole batch (parameters and running stats)."""
    import torch

    import paratrain

    device = _device(mode)
    batches = _batches(5, 16, (3, 8, 8))
    torch.manual_seed(1)
    ref = _bn_cnn()
    init = copy.deepcopy(ref.state_dict())
    ref = ref.to(device)
    _plain_sgd(ref, batches, device)
    results = paratrain.launch(_syncbn_worker, nprocs=2, args=(mode, batches, init), timeout=max(30.0, budget - 20),
                               env={"OMP_NUM_THREADS": "1"})
    want_kind = "torch.nn.modules.batchnorm.SyncBatchNorm" if mode == "gpu" else "paratrain.nn.syncbn.SyncBatchNorm"
    for r in results:
        if r["kinds"] != [want_kind]:
            raise CheckFailed(f"sync_batchnorm=True on {r['device']} gave {r['kinds']}, not [{want_kind}]")
    err, key = _state_rel(results[0]["state"], {k: v.cpu() for k, v in ref.state_dict().items()})
    agree, _ = _state_rel(results[1]["state"], results[0]["state"])
    print(f"ranks on {[r['device'] for r in results]} over {results[0]['backend']}: worst vs one process {key} "
          f"{err:.2e}; rank 1 vs rank 0 {agree:.2e}")
    if not (err <= 1e-4 and agree <= 1e-6):
        raise CheckFailed(f"SyncBatchNorm x2 differs from BatchNorm over the whole batch: {key} {err:.2e} > 1e-4 "
                          f"(ranks apart by {agree:.1e})")
    return Result(f"{want_kind.rsplit('.', 1)[-1]} ({want_kind.split('.')[0]}) x2 on {results[0]['device']} over "
                  f"{results[0]['backend']}: 5 steps = one process with BatchNorm (rel. {err:.1e})",
                  {"kind": want_kind, "rel_err": err, "device": results[0]["device"]})


# --------------------------------------------------------------------------- torch.compile


def compile_check(mode: str, budget: float) -> Result:
    """``Parallel(compile=True)`` (inductor on the GPU; ``aot_eager`` on the CPU twin, which needs
    no C++ compiler and takes seconds) against the same loop uncompiled."""
    import torch
    import torch.nn.functional as F

    import paratrain

    device = _device(mode)
    backend = "inductor" if mode == "gpu" else "aot_eager"
    batches = _batches(6, 32, (3, 16, 16))
    torch.manual_seed(1)
    base = _bn_cnn()
    out: dict[bool, Any] = {}
    seconds = {}
    for compiled in (False, True):
        pt = paratrain.Parallel(strategy="single", compile=compiled, compile_backend=backend, global_batch=32,
                                accelerator="cuda" if mode == "gpu" else "cpu")
        m = copy.deepcopy(base)
        model, opt = pt.setup(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9))
        t0 = time.monotonic()
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(pt.device)), y.to(pt.device))
            pt.backward(loss)
            opt.step()
            losses.append(float(loss.detach()))
        seconds[compiled] = time.monotonic() - t0
        out[compiled] = ({k: v.detach().cpu() for k, v in model.state_dict().items()}, losses)
        pt.close()
    (eager, eager_losses), (comp, comp_losses) = out[False], out[True]
    if set(comp) != set(eager):  # a compiled model's state keeps the uncompiled keys (no _orig_mod.)
        raise CheckFailed(f"the compiled model's state keys differ: {sorted(set(comp) ^ set(eager))[:4]}")
    err, key = _state_rel(comp, eager)
    print(f"losses eager {eager_losses}\n       compiled {comp_losses}\nworst parameter {key}: {err:.2e}; "
          f"{seconds[True]:.1f} s compiled (compilation included), {seconds[False]:.2f} s eager")
    if not err <= 1e-3:
        raise CheckFailed(f"torch.compile ({backend}) drifts from eager after {len(batches)} steps: "
                          f"{key} {err:.2e} > 1e-3")
    return Result(f"Parallel(compile=True), {backend} on {device}: {len(batches)} steps = eager (rel. {err:.1e}); "
                  f"{seconds[True]:.0f} s with compilation", {"backend": backend, "rel_err": err,
                                                              "compiled_s": seconds[True], "eager_s": seconds[False]})


# --------------------------------------------------------------------------- the predictor (item 4)


def _bench_step_time(cfg: Any, strategy: str, world: int, epochs: int, timeout: float) -> float:
    import dataclasses

    from paratrain.bench import quick_spec, run_bench

    spec = dataclasses.replace(quick_spec(), strategies=[strategy], world_sizes=[world], precisions=["32"],
                               comm_hooks=["none"], epochs=epochs, baseline=False, trap=False, nccl_cells=False,
                               cell_timeout=timeout)
    res = run_bench(spec, cfg, progress=False)
    ok = [r for r in res.results if r.status == "ok" and r.cell.world_size == world and r.step_time_s]
    if not ok:
        raise CheckFailed(f"{strategy} x{world} did not run: {[r.reason for r in res.results]}")
    return float(ok[0].step_time_s or 0.0)


def predict_check(mode: str, budget: float) -> Result:
    """The predictor of ``paratrain bench --predict`` against ddp measured over loopback gloo on the
    CPU (weak scaling: each worker keeps the per-worker batch): world sizes 4 and 8 on a GPU
    machine's cores (``--mode cpu``: 2, what 2 cores hold). Compute is ``single`` at the per-worker
    batch; the link is fitted to gloo all-reduces between 2 local processes, as bench does. It records
    the error of the prediction with all communication exposed and with none; it fails only when
    something does not run."""
    from paratrain.bench.predict import Workload, predict
    from paratrain.bench.scaling import measured_link
    from paratrain.config import TrainConfig

    cores = os.cpu_count() or 1
    if mode == "gpu":
        sizes, model, batch, size, epochs = [4, 8], "resnet8", 32, 4096, 1
        sizes = [n for n in sizes if n <= cores] or [2]
    else:
        sizes, model, batch, size, epochs = [2], "mlp", 16, 1024, 1
    base = {"model": model, "data.dataset": "synthetic", "data.synthetic_size": size, "parallel.accelerator": "cpu"}
    t0 = time.monotonic()
    link = measured_link()
    cell_timeout = max(30.0, budget / (2 + len(sizes)))
    compute = _bench_step_time(TrainConfig.load(None, {**base, "parallel.global_batch": batch}), "single", 1, epochs,
                               cell_timeout)
    cfg = TrainConfig.load(None, base)
    shapes = tuple(tuple(p.shape) for p in cfg.build_model().parameters() if p.requires_grad)
    print(f"{model} on synthetic ({size} samples), {batch} per worker, {cores} cores; link {link.describe()}; "
          f"single {compute * 1e3:.1f} ms a step ({time.monotonic() - t0:.0f} s so far)", flush=True)
    rows = []
    for n in sizes:
        measured = _bench_step_time(TrainConfig.load(None, {**base, "parallel.global_batch": n * batch}), "ddp", n,
                                    epochs, cell_timeout)
        row: dict[str, Any] = {"workers": n, "measured_ms": measured * 1e3}
        for exposed in (1.0, 0.0):
            (p,) = predict(Workload(compute, batch, shapes, exposed), link, ["all-reduce (ddp)"], [n])
            row[f"predicted_ms_exposed_{exposed:.0f}"] = p.step_s * 1e3
            row[f"error_pct_exposed_{exposed:.0f}"] = 100 * (p.step_s - measured) / measured
        rows.append(row)
        print(f"ddp x{n}: measured {measured * 1e3:.1f} ms; predicted {row['predicted_ms_exposed_1']:.1f} ms "
              f"({row['error_pct_exposed_1']:+.0f}%) all exposed, {row['predicted_ms_exposed_0']:.1f} ms "
              f"({row['error_pct_exposed_0']:+.0f}%) none", flush=True)
    summary = "; ".join(f"x{r['workers']}: measured {r['measured_ms']:.0f} ms, predicted "
                        f"{r['predicted_ms_exposed_1']:.0f} ms ({r['error_pct_exposed_1']:+.0f}%, exposed 1) / "
                        f"{r['predicted_ms_exposed_0']:.0f} ms ({r['error_pct_exposed_0']:+.0f}%, exposed 0)"
                        for r in rows)
    return Result(f"{model}, {batch}/worker, gloo loopback: {summary}",
                  {"model": model, "batch_per_worker": batch, "cores": cores, "link": link.describe(),
                   "single_ms": compute * 1e3, "rows": rows})


CHECKS["compile"] = compile_check
CHECKS["predict"] = predict_check
