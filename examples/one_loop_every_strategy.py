"""One training loop, every strategy: only ``--strategy`` changes, and so does nothing else.

    python examples/one_loop_every_strategy.py --strategy single
    python -m paratrain run --nproc-per-node 2 examples/one_loop_every_strategy.py --strategy ddp
    python -m paratrain run --nproc-per-node 2 examples/one_loop_every_strategy.py --strategy fsdp
    python -m paratrain run --nproc-per-node 2 examples/one_loop_every_strategy.py --strategy tensor
    python -m paratrain run --nproc-per-node 2 examples/one_loop_every_strategy.py --strategy pipeline
    python -m paratrain run --nproc-per-node 2 examples/one_loop_every_strategy.py --strategy ps

Each run prints the test accuracy and a checksum of the trained weights. In fp32 the checksums
agree across strategies and process counts (to the printed digits): the global
batch, the data order and the initial weights are the same, only the way the work is split differs.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import paratrain
from paratrain.data.datasets import build_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="single", help="single, ddp, fsdp, tensor, pipeline, ps, dp or devices")
    parser.add_argument("--precision", default="32")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of 64 samples")
    args = parser.parse_args()

    pt = paratrain.Parallel(strategy=args.strategy, precision=args.precision, global_batch=64, seed=0)
    # Top-level layers called in order (so pipeline can cut it), a Linear -> ReLU -> Linear pair
    # (so tensor can split it).
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = pt.setup(model, optimizer)

    train_set, test_set = build_dataset("digits", True), build_dataset("digits", False)
    loader = pt.train_loader(train_set)  # this rank's share of each global batch, epoch after epoch
    while pt.global_step < args.steps:
        for batch in loader:
            optimizer.zero_grad()
            pt.training_step(model, batch)  # forward, loss and backward, the way the strategy runs them
            optimizer.step()
            if pt.global_step >= args.steps:
                break

    metrics = pt.evaluate(model, pt.eval_loader(test_set))  # every test sample counted once
    state = pt.full_state_dict(model)  # the whole trained model on every rank (unsharded, all stages)
    checksum = sum(float(v.double().sum()) for v in state.values())
    pt.print(f"{args.strategy} on {pt.world_size} process(es): test accuracy {metrics['accuracy']:.4f}, "
             f"weights checksum {checksum:.4f}")
    pt.close()


if __name__ == "__main__":
    main()
