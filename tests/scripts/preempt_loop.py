"""An own loop that stops on a preemption signal: ``pt.save_on_stop`` once, ``pt.should_stop`` per step.

Usage: ``paratrain run --nproc-per-node 2 tests/scripts/preempt_loop.py OUT CKPT_DIR RESUME(0/1) SIGNAL STEP``:
rank 0 sends SIGNAL (``none``: no signal) to its launcher after optimizer step STEP of a fresh run, as
Slurm or Kubernetes would to the job; a finished run saves its whole state to OUT.
"""

import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain

STEPS = 60

if __name__ == "__main__":
    out, ckpt, resume, sig, at = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4], int(sys.argv[5])
    pt = paratrain.Parallel(strategy="ddp", global_batch=16, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).double()
    model, opt = pt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(160, 8, generator=g, dtype=torch.float64), torch.randint(0, 2, (160,), generator=g))
    pt.save_on_stop(ckpt, model, opt)  # what a stop signal saves
    if resume:
        pt.resume(ckpt, model, opt)
    loader = pt.train_loader(data)
    while pt.global_step < STEPS and not pt.should_stop:
        for x, y in loader:
            opt.zero_grad()
            pt.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            if sig != "none" and not resume and pt.rank == 0 and pt.global_step == at:
                os.kill(int(os.environ["PARATRAIN_AGENT_PID"]), getattr(signal, sig))
            if pt.should_stop or pt.global_step >= STEPS:
                break
    if not pt.should_stop:
        state = pt.full_state_dict(model)
        if pt.is_main_process:
            torch.save(state, out)
    pt.close()
