"""The device check: ranks that fall out of step, named in one line under nccl (issue 36 item 6).

On a machine with 2 or more GPUs, ``tests/trace/test_hangs.py`` runs as it runs in CI, but its
workers' ``Parallel`` picks nccl with a GPU each: a skipped collective, other sizes, another op, a
rank that never arrives and an error inside an fsdp step, under ``paratrain.launch`` and
``paratrain run``, each ending in the one line within ``timeout_s`` + 15 s, then ``paratrain
doctor``. One GPU cannot hold two nccl ranks: there the nccl step checks Flight Recorder's dump
instead. The CPU twin is the suite's own run of the same file over gloo.
"""

from __future__ import annotations

import os

from .base import ROOT, Result, Skip, _run, check


@check
def hangs(mode: str, budget: float) -> Result:
    if mode == "cpu":  # the driver's dry run skips it before it starts (Step.no_twin)
        raise Skip("the suite runs these cases over gloo (tests/trace/test_hangs.py)")
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise Skip(f"the nccl cases need 2 GPUs, {gpus} visible (the nccl step checks Flight Recorder's dump instead)")
    res = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ROOT,
                os.path.join(ROOT, "tests", "trace", "test_hangs.py")], max(60.0, budget - 10), "the hang cases under nccl")
    last = (res.stdout.strip().splitlines() or ["?"])[-1]
    return Result(f"tests/trace/test_hangs.py under nccl on {gpus} GPUs: {last}", {"gpus": gpus, "pytest": last})
