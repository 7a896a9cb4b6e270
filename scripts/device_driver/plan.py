"""The plan: the steps in order, what each wants and needs of the budget, and how a slice is cut."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_BUDGET", "DEFAULT_DRY_BUDGET", "Step", "STEPS", "SELFTEST_SECTIONS", "OPTIONAL", "plan_slice",
           "inner_budget", "kill_room"]

DEFAULT_BUDGET = 540.0
DEFAULT_DRY_BUDGET = 180.0
"""On a quiet 2-core machine: the LM twin (second, after the probe and nccl) gets its want while every
later step keeps its need (tests/scripts/test_device_check.py)."""

@dataclass(frozen=True)
class Step:
    name: str
    what: str
    want: float | None
    """Seconds it is given when the budget holds every step; None: what the others leave."""
    need: float
    """Below this it is skipped."""
    dry_want: float | None
    dry_need: float
    gpu_only: bool = False
    packages: tuple[str, ...] = ()
    """Needed to run at all (a missing one skips the step)."""
    no_twin: str | None = None
    """Why the dry run has no CPU twin of it (then it is skipped there, and its dry want and need are 0)."""
    min_gpus: int = 0
    """GPUs it needs (fewer visible: skipped before it starts)."""

    def want_for(self, dry: bool) -> float | None:
        return self.dry_want if dry else self.want

    def need_for(self, dry: bool) -> float:
        return self.dry_need if dry else self.need


STEPS: tuple[Step, ...] = (
    Step("nccl", "nccl at world size 1: collectives, all_gather/reduce, DDP = plain loop; Flight Recorder's dump on "
         "a timeout, read back by doctor", 90, 45, 30, 10, True),
    Step("lm", "GPT-2 124M: tokens/s, MFU and memory of the plain loop, paratrain, Accelerate, Fabric "
         "(paratrain selftest --sections lm)", 300, 120, 40, 30),
    Step("hangs", "ranks out of step under nccl, one line each (tests/trace/test_hangs.py on 2+ GPUs)",
         240, 20, 0, 0, True, packages=("pytest",), min_gpus=2,
         no_twin="the suite runs these cases over gloo (tests/trace/test_hangs.py)"),
    Step("fsdp_bf16", "fsdp + bf16-mixed = single + bf16-mixed, and with cpu_offload (paratrain train)",
         90, 30, 60, 15, True),
    Step("fp16_scaler", "fp16-mixed with torch.amp's CUDA GradScaler: follows fp32, skips an inf step",
         40, 15, 30, 10, True),
    Step("syncbn", "nn.SyncBatchNorm (sync_batchnorm=True), ddp x2 = BatchNorm over the whole batch",
         60, 25, 60, 15, True),
    Step("compile", "torch.compile (Parallel(compile=True), inductor) = eager", 100, 45, 45, 10, True),
    Step("bench_quick", "paratrain bench --quick", 75, 30, 60, 15),
    Step("dataloader", "batched loader / per-sample DataLoader, float32 (benchmarks/dataloader.py)", 45, 15, 30, 10),
    Step("predict", "bench --predict's model vs ddp measured at 4 and 8 workers, loopback gloo", 120, 30, 60, 15),
    Step("seed_table", "the seed's table on ResNet-50 (paratrain selftest --sections resnet50)", 130, 50, 30, 15),
    Step("selftest", "paratrain selftest (its other sections, with the time left)", None, 90, 40, 20),
)
"""Wants and needs (seconds) as measured or expected on one H100 with 16 cores (the dry run's on 2
CPU cores): the fixed steps' wants are generous caps; selftest, last, fills what they leave (in the dry run 40 s:
with 20 its budget ran none of its sections, which only this step runs on the oldest torch)."""

SELFTEST_SECTIONS = ("correctness", "layouts", "collectives", "speed", "lm", "memory", "resnet50", "compile")
"""paratrain.selftest.run.SECTIONS (this driver imports nothing from paratrain; a test keeps them equal)."""

OPTIONAL = {
    "matplotlib": "bench_quick's chart.png and predict.png",
    "torchvision": "dataloader's per-sample torchvision transforms vs BatchAugment; torchvision:<name> models",
    "triton": "compile (inductor on CUDA needs triton)",
    "accelerate": "selftest's speed row for Accelerate",
    "lightning": "selftest's speed row for Lightning",
    "torchao": "lm's fp8-mixed row (no network there: `bash scripts/device_check.sh --bring` here, carry build/device-site)",
}
"""Packages whose absence skips a row, and which rows."""

def plan_slice(remaining: float, want: float | None, need: float,
               later: list[tuple[float | None, float]]) -> float | None:
    """Seconds for a step, given the ``remaining`` budget and the ``(want, need)`` of the steps still
    to run after it; None: skip it (its need would leave the later steps less than theirs).

    A step with a ``want`` gets at most that; one without (selftest) gets what the later steps'
    wants leave, at least its need. No step takes what the later steps need."""
    hi = remaining - sum(n for _, n in later)
    if hi < need:
        return None
    if want is not None:
        return min(want, hi)
    return max(need, min(hi, remaining - sum(n if w is None else max(w, n) for w, n in later)))


def inner_budget(slice_s: float) -> float:
    """What a step that keeps its own budget (selftest) is told: its slice less the time to start
    and to write its report (15%, 10-30 s)."""
    return max(slice_s / 2, slice_s - min(30.0, max(10.0, 0.15 * slice_s)))


def kill_room(budget: float, dry: bool) -> float:
    """How many times its slice a step may run before it is killed: a dry run's budget above
    :data:`DEFAULT_DRY_BUDGET` is a slower or busier machine's (CI gives it the machine's pace), and its steps get
    that much room; what a step does within its slice is its own budget, as planned. 1 for a GPU run, whose
    budget is the device time to spend."""
    return max(1.0, budget / DEFAULT_DRY_BUDGET) if dry else 1.0
