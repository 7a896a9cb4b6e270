"""``paratrain selftest``: does this machine, this torch and this network train correctly, and how fast?

Within one time budget, on whatever hardware it finds, in this order:

* **correctness** (:mod:`.correctness`): a short fixed-seed run of every strategy and precision the
  hardware supports, compared with a one-process reference; a divergence fails the command;
* **collectives** (:mod:`.collectives`): ``all_reduce``/``all_gather`` latency and bus bandwidth as
  nccl-tests computes them;
* **speed** (:mod:`.speed`): paratrain's ``ddp`` (and Accelerate's and Lightning's, where they
  import) against the hand-written DDP loop, interleaved; **memory**: each strategy's peak per rank;
* **resnet50** (:mod:`.seed`): single vs DataParallel vs DDP vs mixed precision on ResNet-50, beside a
  published CIFAR-10 tutorial's table;
* **compile**: whether ``torch.compile`` works here; plus the device facts (:mod:`.facts`).

What does not fit the budget, or this hardware, is listed with the reason.
"""

from .report import Report, Row
from .run import SECTIONS, SelftestOptions, run_selftest

__all__ = ["Report", "Row", "SECTIONS", "SelftestOptions", "run_selftest"]
