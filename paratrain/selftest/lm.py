"""The language-model rows (``paratrain selftest --sections lm``): a GPT-2 124M-shaped model (nanoGPT's
GPT, :mod:`paratrain.models.gpt`) on random tokens, trained in one process by

* the plain loop: nanoGPT's ``train.py`` as written (autocast, AdamW with its two weight-decay groups,
  fused on CUDA, ``torch.compile``, ``GradScaler`` for fp16, gradient clipping at 1.0);
* ``Parallel`` single, ddp x1 and fsdp x1 (the same step through paratrain);
* Accelerate and Lightning Fabric, as their documentation writes the loop, where they import.

The loops are stepped in blocks, ABBA (:func:`paratrain.bench.overhead.interleave`), so other load on
the machine hits every loop alike. Each row reports tokens per second, MFU (nanoGPT's FLOPs per token,
:func:`~paratrain.models.gpt.flops_per_token`, against the device's dense bf16 peak, which the row names)
and the peak memory of that loop (what it held above the process before it was built, activations
included), and paratrain's rows their tokens per second over the plain loop's, with the spread of the
per-round ratios. The goal: single and ddp within 2% of the plain loop, ahead of Accelerate and Fabric.

On a machine without a GPU the same rows run as a CPU twin at tiny size (eager, fp32 weights with
bf16 autocast): that the loops run and agree, not their speed.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import io
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Generator

import torch

from .. import precision as precision_lib
from .. import strategies
from ..models.gpt import GPT, GPTConfig, flops_per_token, token_loss
from .budget import Deadline
from .report import FAIL, OK, SKIPPED, Report
from .speed import FRAMEWORKS  # the other loops' names and the module each needs

__all__ = ["LMJob", "lm_job", "lm_strategies", "lm_precisions", "peak_bf16_flops", "lm_worker", "run_lm", "GOAL"]

GOAL = 0.98
"""paratrain single and ddp reach at least this share of the plain loop's tokens per second (on a GPU)."""
LM_SECONDS = {"cpu": 20.0, "cuda": 200.0}
"""What the first precision's rows take, start-up and compilation included: not started when less is left
(the worker judges the later ones by what the first took)."""
LOSS_TOLERANCE = 0.05
"""Every loop's loss after the same steps is within this share of the plain loop's (fp8-mixed's too,
against the plain loop in bf16)."""
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.5), ("H200", 989.5), ("H100 PCIe", 756.0), ("H100", 989.5), ("H800", 989.5), ("B200", 2250.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0),
    ("A10", 125.0), ("RTX 4090", 165.2), ("RTX 3090", 71.0), ("V100", 125.0), ("T4", 65.0),
)
"""Dense bf16 (V100, T4: fp16) tensor-core peak, TFLOPS, by a part of the device's name (first match;
the more specific names first): the vendors' data sheets, without sparsity."""


@dataclass(frozen=True)
class LMJob:
    """One precision's rows: the model, the batch, the steps and which loops run."""

    config: GPTConfig
    batch: int
    precision: str
    """``bf16-mixed`` or ``fp16-mixed`` (the plain loop: the same autocast dtype)."""
    compile: bool
    steps: int
    block: int
    warmup: int
    loops: tuple[str, ...] = ("plain",)
    """``plain`` and paratrain's strategies (:func:`lm_strategies`)."""
    frameworks: tuple[str, ...] = ()
    accelerator: str = "cpu"

    def __post_init__(self) -> None:
        if self.precision not in (*lm_precisions(), *float8_precisions()):
            raise ValueError(f"the LM rows run {', '.join((*lm_precisions(), *float8_precisions()))}, "
                             f"not {self.precision!r}")

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype (what the plain loop and the other frameworks are told)."""
        dtype = precision_lib.lookup(self.precision).param_dtype  # what the layers compute in under its autocast
        assert dtype is not None
        return dtype

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.config.block_size


def lm_strategies() -> list[str]:
    """paratrain's loops: every strategy that runs each layer whole in each process (single, ddp, fsdp),
    at world size 1."""
    return [n for n in strategies.STRATEGIES if strategies.resolve(n).whole_layers]


def lm_precisions() -> list[str]:
    """The mixed precisions the rows run, the one without loss scaling (bf16-mixed) first."""
    names = [n for n, c in precision_lib.PRECISIONS.items() if c.autocast and not c.master_weights and not c.float8]
    return sorted(names, key=lambda n: precision_lib.lookup(n).scales_loss)


def float8_precisions() -> list[str]:
    """fp8-mixed: its row trains paratrain's one-device loop in float8 beside the plain bf16 loop."""
    return [n for n, c in precision_lib.PRECISIONS.items() if c.float8]


def lm_job(accelerator: str, precision: str | None = None, frameworks: tuple[str, ...] = ()) -> LMJob:
    """GPT-2 124M at sequence 1024 and batch 8 with ``torch.compile`` on a GPU, 80 timed steps a loop; a 2-layer, 64-wide
    twin at sequence 64, eager, on the CPU. bf16-mixed (the default) runs every loop; fp16-mixed the plain
    loop and paratrain's unsharded ones (the rows that settle fp16's speed; the CPU twin: the
    one-device one), no other framework."""
    precision = precision or lm_precisions()[0]
    ours = lm_strategies()
    if precision_lib.lookup(precision).scales_loss:
        ours = [n for n in ours if not strategies.resolve(n).sharded_state]
        ours = ours if accelerator == "cuda" else [strategies.reference()]
        frameworks = ()
    if precision_lib.lookup(precision).float8:  # the plain loop stays bf16: the row is fp8 against bf16
        ours, frameworks = [strategies.reference()], ()
    loops = ("plain", *ours)
    if accelerator == "cuda":
        # 80 steps in blocks of 10 (about 0.2 s a block on an H200): with 40 in blocks of 5 one run's per-round
        # ratios spread over 0.82-1.07; the steps cost seconds beside each loop's compilation
        return LMJob(config=GPTConfig(), batch=8, precision=precision, compile=True, steps=80, block=10, warmup=3,
                     loops=loops, frameworks=frameworks, accelerator=accelerator)
    return LMJob(config=GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=64), batch=4,
                 precision=precision, compile=False, steps=8, block=2, warmup=1, loops=loops, frameworks=frameworks,
                 accelerator=accelerator)


def peak_bf16_flops(device: torch.device) -> tuple[float | None, str]:
    """The device's dense bf16 peak in FLOP/s and its name, from :data:`PEAK_BF16_TFLOPS` (None where
    the table does not know it, and on the CPU)."""
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in name:
            return tflops * 1e12, name
    return None, name


# --------------------------------------------------------------------------- the loops (in the worker)

def random_batches(job: LMJob, device: torch.device, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of random token ids and their next tokens, made once on the device (no loader is timed)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, job.config.vocab_size, (job.batch, job.config.block_size + 1), generator=g)
        out.append((ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)))
    return out


def nanogpt_adamw(model: torch.nn.Module, device_type: str) -> torch.optim.AdamW:
    """nanoGPT's ``configure_optimizers``: weight decay 0.1 on the 2-D weights, none on biases and norms;
    lr 6e-4, betas (0.9, 0.95); fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=device_type == "cuda")


def _model(job: LMJob) -> GPT:
    torch.manual_seed(0)  # every loop starts from the same weights
    return GPT(job.config)


def plain_steps(job: LMJob, device: torch.device, batches: list[Any]) -> Generator[Any, None, None]:
    """nanoGPT's ``train.py`` loop (one micro-step per optimizer step): the first ``next()`` builds it,
    each later one runs a step and yields its loss."""
    model = _model(job).to(device)
    optimizer = nanogpt_adamw(model, device.type)
    ctx = torch.autocast(device.type, dtype=job.dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=job.dtype == torch.float16)
    net: Any = torch.compile(model) if job.compile else model
    yield net
    while True:
        for x, y in batches:
            with ctx:
                loss = token_loss(net(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            yield loss.detach()


def parallel_lm_steps(job: LMJob, strategy: str, batches: list[Any]) -> Generator[Any, None, None]:
    """The same step through ``Parallel`` (in the process group the worker joined): nanoGPT's ``with ctx:``
    around forward and loss becomes ``with pt.autocast():``."""
    from ..parallel import Parallel

    pt = Parallel(strategy=strategy, precision=job.precision, compile=job.compile, clip_grad_norm=1.0,
                  global_batch=job.batch, accelerator=job.accelerator, seed=0)
    model = _model(job)
    model, optimizer = pt.setup(model, nanogpt_adamw(model, pt.device.type))
    yield model
    while True:
        for x, y in batches:
            with pt.autocast():
                loss = token_loss(model(x), y)
            pt.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            yield loss.detach()


def accelerate_lm_steps(job: LMJob, device: torch.device, batches: list[Any]) -> Generator[Any, None, None]:
    """The loop as Accelerate's documentation writes it (``prepare``, ``backward``, ``clip_grad_norm_``)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision={torch.bfloat16: "bf16"}.get(job.dtype, "fp16"),
                              dynamo_backend="inductor" if job.compile else "no")
    model = _model(job)
    model, optimizer = accelerator.prepare(model, nanogpt_adamw(model, device.type))
    yield model
    while True:
        for x, y in batches:
            loss = token_loss(model(x), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            yield loss.detach()


def fabric_lm_steps(job: LMJob, device: torch.device, batches: list[Any]) -> Generator[Any, None, None]:
    """The loop as Lightning Fabric's documentation writes it (``torch.compile`` before ``setup``)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu", devices=1,
                    precision="bf16-mixed" if job.dtype == torch.bfloat16 else "16-mixed")  # Fabric's names
    model = _model(job)
    optimizer = nanogpt_adamw(model, device.type)  # on the CPU: fused would need the weights on CUDA first
    net: Any = torch.compile(model) if job.compile else model
    net, optimizer = fabric.setup(net, optimizer)
    yield net
    while True:
        for x, y in batches:
            loss = token_loss(net(x), y)
            fabric.backward(loss)
            fabric.clip_gradients(net, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            yield loss.detach()


def lm_worker(local_rank: int, jobs: list[LMJob], until: float = float("inf")) -> list[dict[str, Any]]:
    """In the one launched process: each job's loops, one job after the other (:func:`run_job`). A job
    after the first runs only if it fits before ``until`` (``time.time()``), judged by the time the
    jobs before it took per loop (compilation included); else its result is ``{"skipped": why}``."""

    import torch.distributed as dist

    from ..env.devices import select_device

    warnings.simplefilter("ignore")
    device = select_device(local_rank, jobs[0].accelerator)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    results: list[dict[str, Any]] = []
    per_loop, loops_run = 0.0, 0
    try:
        for job in jobs:
            n = len(job.loops) + len(job.frameworks)
            expect = per_loop / loops_run * n if loops_run else 0.0
            if time.time() + expect > until:
                results.append({"skipped": f"budget: {max(0.0, until - time.time()):.0f} s left, its {n} loops take "
                                           f"about {expect:.0f} s here"})
                continue
            t0 = time.monotonic()
            results.append(run_job(job, device))
            per_loop, loops_run = per_loop + time.monotonic() - t0, loops_run + n
        return results
    finally:
        dist.destroy_process_group()


def run_job(job: LMJob, device: torch.device) -> dict[str, Any]:
    """Build every loop of ``job`` (measuring each one's peak memory as it is built and warmed up),
    interleave them, return their step times and losses; the loops are freed at the end."""
    from ..bench.measure import PeakMemory
    from ..bench.overhead import interleave

    batches = random_batches(job, device)
    makers: dict[str, Callable[[], Generator[Any, None, None]]] = {
        "plain": lambda: plain_steps(job, device, batches),
        "accelerate": lambda: accelerate_lm_steps(job, device, batches),
        "lightning": lambda: fabric_lm_steps(job, device, batches)}
    for n in lm_strategies():
        makers[n] = functools.partial(parallel_lm_steps, job, n, batches)
    memory = PeakMemory(device)
    loops: dict[str, Any] = {}
    peaks: dict[str, int] = {}
    failed: dict[str, str] = {}
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for name in (*job.loops, *job.frameworks):
                before = memory.current()
                memory.reset()
                try:
                    loop = makers[name]()
                    next(loop)  # built
                    for _ in range(job.warmup):  # compiled, optimizer state made
                        next(loop)
                except Exception as e:  # another framework's set-up fails alone; paratrain's and the plain loop's do not
                    if name not in job.frameworks:
                        raise
                    failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    continue
                loops[name] = loop
                peaks[name] = max(0, memory.read() - before)
            sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
            timed = interleave(loops, job.steps, job.block, warmup=0, first="plain", sync=sync)
        flops, device_name = peak_bf16_flops(device)
        return {"wall": timed["wall"], "peak_bytes": peaks, "failed": failed,
                "last_loss": {n: float(v[-1]) for n, v in timed["outputs"].items()},
                "device": device_name, "peak_flops": flops, "memory_method": memory.method}
    finally:
        for loop in loops.values():
            loop.close()
        loops.clear()
        gc.collect()  # a Parallel is in a reference cycle: its model and optimizer state go only now
        if job.compile:
            torch._dynamo.reset()  # the compiled graphs (and what they hold) of this job's loops
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the rows (in the parent)

@dataclass
class LMRow:
    """One loop's numbers."""

    loop: str
    tokens_per_s: float
    mfu: float | None
    peak_mib: float
    ratio: float | None = None
    """Its tokens per second over the plain loop's (pooled medians); None for the plain loop."""
    rounds: list[float] = field(default_factory=list)
    """The per-round ratios."""


LABELS = {"plain": "plain loop (nanoGPT train.py)", "accelerate": "Accelerate", "lightning": "Lightning Fabric"}
"""The rows' names; paratrain's: ``paratrain <strategy>`` (`` x1`` where it can run on more processes)."""


def label(loop: str) -> str:
    if loop in LABELS:
        return LABELS[loop]
    return f"paratrain {loop}" + ("" if strategies.resolve(loop).processes == "one" else " x1")


def judged_loops() -> tuple[str, ...]:
    """The rows the goal holds for: the one-device strategy and the plain data-parallel one (single, ddp)."""
    return strategies.reference(), strategies.data_parallel_reference()


def lm_rows(job: LMJob, result: dict[str, Any]) -> list[LMRow]:
    """Tokens per second, MFU, peak memory and the ratio to the plain loop of every loop of one run."""
    from ..bench.overhead import round_ratios

    with torch.device("meta"):
        per_token = flops_per_token(GPT(job.config))
    wall: dict[str, list[list[float]]] = result["wall"]
    plain = wall["plain"]
    rows = []
    for name, rounds in wall.items():
        step = statistics.median([s for r in rounds for s in r])
        tps = job.tokens_per_step / step
        mfu = per_token * tps / result["peak_flops"] if result.get("peak_flops") else None
        row = LMRow(name, tps, mfu, result["peak_bytes"].get(name, 0) / 2**20)
        if name != "plain":
            row.ratio = statistics.median([s for r in plain for s in r]) / step
            row.rounds = round_ratios(plain, rounds)  # per round: the plain step over this loop's
        rows.append(row)
    return rows


def describe(row: LMRow, device: str, memory_method: str = "cuda-max-allocated") -> str:
    mfu = f"MFU {row.mfu:.1%} of {device}'s dense bf16 peak" if row.mfu is not None else \
        f"MFU n/a (no peak known for {device})"
    peak = "" if memory_method.startswith("cuda") else f" ({memory_method}: what the process grew by)"
    text = f"{row.tokens_per_s:,.0f} tokens/s, {mfu}, peak {row.peak_mib:,.0f} MiB{peak}"
    if row.ratio is not None:
        lo, hi = (min(row.rounds), max(row.rounds)) if row.rounds else (row.ratio, row.ratio)
        text += f"; {row.ratio:.3f}x the plain loop's tokens/s (rounds {lo:.3f}-{hi:.3f}, {len(row.rounds)} rounds)"
    return text


def run_lm(report: Report, accelerator: str, deadline: Deadline,
           precisions: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """The LM rows of ``precisions`` (default :func:`lm_precisions`), in one launched process; returns
    every row's numbers (also in the report's rows)."""
    from ..launch.spawn import LaunchError, launch

    frameworks = []
    for name, module in FRAMEWORKS.items():
        if importlib.util.find_spec(module) is None:
            report.add("lm", f"{label(name)} {lm_precisions()[0]}", SKIPPED,
                       f"{module} is not installed (pip install {module})")
        else:
            frameworks.append(name)
    if precisions is None:
        device = torch.device("cuda", 0) if accelerator == "cuda" else torch.device("cpu")
        float8 = []
        for name in float8_precisions():
            why = precision_lib.lookup(name).unsupported(device)
            if why is None:
                float8.append(name)
            else:
                report.add("lm", f"LM rows {name}", SKIPPED, why)
        first, *rest = lm_precisions()  # fp8 second: its two loops before fp16's three when time runs short
        precisions = (first, *float8, *rest)
    jobs = [lm_job(accelerator, p, tuple(frameworks)) for p in precisions]
    seconds = LM_SECONDS["cuda" if accelerator == "cuda" else "cpu"]
    if not deadline.allows(seconds, "lm"):  # the first precision's rows; the worker judges the others by it
        for job in jobs:
            report.add("lm", f"LM rows {job.precision}", SKIPPED, f"budget: {deadline.left:.0f} s left, the rows "
                                                                   f"take about {deadline.expect(seconds, 'lm'):.0f} s here")
        return []
    try:  # one process for every precision: one start-up
        with deadline.part(seconds * len(jobs), "lm"):
            (results,) = launch(lm_worker, 1, args=(jobs, time.time() + deadline.left),
                                timeout=max(120.0, deadline.left * 2), env={"OMP_NUM_THREADS": "1"},
                                start_method="forkserver", preload=["paratrain"])
    except LaunchError as e:
        report.add("lm", f"LM rows {', '.join(j.precision for j in jobs)}", FAIL, str(e))
        return []
    out: list[dict[str, Any]] = []
    for job, result in zip(jobs, results):
        if "skipped" in result:
            report.add("lm", f"LM rows {job.precision}", SKIPPED, result["skipped"])
            continue
        judged = accelerator == "cuda" and not precision_lib.lookup(job.precision).float8  # fp8: its speed-up
        for name, why in result.get("failed", {}).items():
            report.add("lm", f"{label(name)} {job.precision}", FAIL, f"its loop did not set up: {why}")
        size = f"GPT {job.config.n_layer}x{job.config.n_embd}, seq {job.config.block_size}, batch {job.batch}"
        for row in lm_rows(job, result):
            status = OK
            if judged and row.loop in judged_loops() and row.ratio is not None and row.ratio < GOAL:
                status = FAIL
            note = "" if judged else " (CPU twin: speed not judged)"
            if row.loop in lm_strategies() and strategies.resolve(row.loop).processes != "one":
                note += " (at world size 1 paratrain runs it without the strategy's wrapper, as in any one-process job)"
            report.add("lm", f"{label(row.loop)} {job.precision}", status,
                       f"{describe(row, result['device'], result['memory_method'])} ({size}){note}", **asdict(row),
                       precision=job.precision, device=result["device"], peak_flops=result["peak_flops"],
                       memory_method=result["memory_method"], last_loss=result["last_loss"][row.loop])
            out.append({**asdict(row), "precision": job.precision})
        losses = result["last_loss"]
        spread = max(losses.values()) - min(losses.values())
        if not spread <= LOSS_TOLERANCE * max(1.0, abs(losses["plain"])):
            report.add("lm", f"losses agree {job.precision}", FAIL, f"after {job.warmup + job.steps} steps the "
                       f"loops' losses differ by {spread:.3g}, more than {LOSS_TOLERANCE:.0%} of the plain loop's "
                       f"{losses['plain']:.4f}: {losses}")
        else:
            report.add("lm", f"losses agree {job.precision}", OK, f"after {job.warmup + job.steps} steps every loop's "
                       f"loss is within {LOSS_TOLERANCE:.0%} of the plain loop's {losses['plain']:.4f} "
                       f"(apart by {spread:.2g})", losses=losses)
    return out
