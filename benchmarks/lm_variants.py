"""Where paratrain's LM step loses time against the plain loop: the plain loop of
``paratrain selftest --sections lm`` beside variants that each change one thing, interleaved (ABBA),
and a profile of one step of the plain loop and of paratrain single (the CUDA kernels that differ).

    python benchmarks/lm_variants.py [--steps 30] [--variants plain,plain_fp32_out,single,...] [--profile]
    python benchmarks/lm_variants.py --smoke   # 2 steps a variant: checks that it runs (CI)

On a GPU: GPT-2 124M, batch 8, bf16-mixed, ``torch.compile`` (as the LM rows); on the CPU: the
rows' tiny twin, eager (that it runs, not its speed). Prints tokens/s and each variant's ratio to the
plain loop with the spread of the per-round ratios.

* ``plain``: nanoGPT's ``train.py`` loop (the LM rows' reference);
* ``plain_fp32_out``: the same, with the logits cast to fp32 after the autocast region and the loss
  computed outside it (what paratrain, Accelerate and Fabric hand to the user's loss);
* ``plain_fp32_out_compiled``: the same with the autocast region and the cast inside one compiled function;
* ``plain_bf16_loss_outside``: the loss outside autocast on the bf16 logits (no fp32 copy, a bf16 loss);
* ``single``: ``Parallel(strategy="single")`` with the loss under ``pt.autocast()`` (the LM rows' paratrain single);
* ``single_loss_outside``: the same with the loss outside autocast (the model's outputs come back in fp32);
* ``single_compiled_outside``: that, with ``Parallel(compile=False)`` and the returned module compiled by the user.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import statistics
import sys
import warnings
from typing import Any, Callable, Generator

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paratrain.bench.overhead import interleave, round_ratios  # noqa: E402
from paratrain.models.gpt import token_loss  # noqa: E402
from paratrain.selftest.lm import (LMJob, _model, lm_job, nanogpt_adamw, parallel_lm_steps, plain_steps,  # noqa: E402
                                   random_batches)


def _plain(job: LMJob, device: torch.device, batches: list[Any], loss_of: Callable[[Any, Any, Any], Any],
           cast_in_graph: bool = False) -> Generator[Any, None, None]:
    """The plain loop with ``loss_of(net, x, y)`` as its forward and loss; ``cast_in_graph``: the compiled
    function is autocast + forward + the fp32 cast (as Accelerate compiles its wrapped forward)."""
    model = _model(job).to(device)
    optimizer = nanogpt_adamw(model, device.type)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=job.dtype):
            logits = model(x)
        return logits.float()

    fn: Any = forward if cast_in_graph else model
    net: Any = torch.compile(fn) if job.compile else fn
    yield net
    while True:
        for x, y in batches:
            loss = loss_of(net, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            yield loss.detach()


def _paratrain(job: LMJob, batches: list[Any], under_autocast: bool,
               compile_outside: bool = False) -> Generator[Any, None, None]:
    """Parallel single with the loss under ``pt.autocast()`` or outside it; ``compile_outside``: the user
    compiles the module ``setup`` returned (autocast and the fp32 cast inside the graph)."""
    from paratrain.parallel import Parallel

    pt = Parallel(strategy="single", precision=job.precision, compile=job.compile and not compile_outside,
                  clip_grad_norm=1.0, global_batch=job.batch, accelerator=job.accelerator, seed=0)
    model = _model(job)
    model, optimizer = pt.setup(model, nanogpt_adamw(model, pt.device.type))
    net: Any = torch.compile(model) if compile_outside and job.compile else model
    yield net
    while True:
        for x, y in batches:
            with pt.autocast() if under_autocast else contextlib.nullcontext():
                loss = token_loss(net(x), y)
            pt.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            yield loss.detach()


def _autocast_logits(job: LMJob, device: torch.device, net: Any, x: Any) -> Any:
    with torch.autocast(device.type, dtype=job.dtype):
        return net(x)


VARIANTS: dict[str, Callable[[LMJob, torch.device, list[Any]], Generator[Any, None, None]]] = {
    "plain": plain_steps,
    "plain_fp32_out": lambda job, device, batches: _plain(
        job, device, batches, lambda net, x, y: token_loss(_autocast_logits(job, device, net, x).float(), y)),
    "plain_fp32_out_compiled": lambda job, device, batches: _plain(
        job, device, batches, lambda net, x, y: token_loss(net(x), y), cast_in_graph=True),
    "plain_bf16_loss_outside": lambda job, device, batches: _plain(
        job, device, batches, lambda net, x, y: token_loss(_autocast_logits(job, device, net, x), y)),
    "single": lambda job, device, batches: parallel_lm_steps(job, "single", batches),
    "single_loss_outside": lambda job, device, batches: _paratrain(job, batches, under_autocast=False),
    "single_compiled_outside": lambda job, device, batches: _paratrain(job, batches, under_autocast=False,
                                                                       compile_outside=True),
}


def kernel_table(loop: Any, device: torch.device, steps: int = 3, top: int = 12) -> tuple[dict[str, float], str]:
    """The device time of each kernel over ``steps`` steps (µs per step) and a printed table of the top ones."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            next(loop)
        if device.type == "cuda":
            torch.cuda.synchronize()
    per: dict[str, float] = collections.defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) if device.type == "cuda" else e.self_cpu_time_total
        if t:
            per[e.key] += t / steps
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total",
                                      row_limit=top)
    return dict(per), table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile", action="store_true", help="also a kernel profile of plain and single")
    ap.add_argument("--smoke", action="store_true", help="2 steps a variant: checks that it runs (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.block = 2, 1
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    from paratrain.env.network import free_port

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("nccl" if cuda else "gloo")
    job = lm_job("cuda" if cuda else "cpu")
    job = dataclasses.replace(job, steps=args.steps, block=args.block)
    batches = random_batches(job, device)
    names = ["plain", *(n.strip() for n in args.variants.split(",") if n.strip() and n.strip() != "plain")]
    loops = {}
    for name in names:
        loop = VARIANTS[name](job, device, batches)
        next(loop)
        for _ in range(job.warmup):
            next(loop)
        loops[name] = loop
        print(f"{name}: built and warmed up", flush=True)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else None
    timed = interleave(loops, job.steps, job.block, first="plain", sync=sync)
    plain = timed["wall"]["plain"]
    base = statistics.median([s for r in plain for s in r])
    print(f"\n{job.config.n_layer}x{job.config.n_embd}, seq {job.config.block_size}, batch {job.batch}, {job.precision}, "
          f"compile {job.compile}, {device}: {job.steps} steps in blocks of {job.block}")
    for name, rounds in timed["wall"].items():
        step = statistics.median([s for r in rounds for s in r])
        ratios = round_ratios(plain, rounds)
        print(f"{name:26s} {job.tokens_per_step / step:12,.0f} tokens/s  {base / step:.3f}x plain "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f})  loss {float(timed['outputs'][name][-1]):.4f}", flush=True)
    if args.profile:
        tables = {}
        for name in ("plain", "single"):
            if name in loops:
                tables[name] = kernel_table(loops[name], device)
                print(f"\n--- {name}: top kernels ---\n{tables[name][1]}", flush=True)
        if len(tables) == 2:
            a, b = tables["plain"][0], tables["single"][0]
            diff = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))[:15]
            print(f"\n--- per step, single - plain (µs; total {sum(b.values()) - sum(a.values()):+.0f}) ---")
            for k in diff:
                print(f"{b.get(k, 0) - a.get(k, 0):+10.1f}  plain {a.get(k, 0):9.1f}  single {b.get(k, 0):9.1f}  {k[:90]}")
    for loop in loops.values():
        loop.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
