"""A small mixture-of-experts on the CPU, its experts running at once with ``paratrain.fork_map``.

Each token goes to its top-1 expert (a 2-layer MLP), weighted by the gate's probability. The
experts are independent: ``fork_map`` runs expert 0 in the calling thread and the others on
paratrain's thread pool (matmuls release the GIL), with one intra-op thread per expert. The same
model trains with the experts one after another (``--mode sequential``) for comparison; both
runs start from the same weights and see the same batches, so they end with the same weights (up
to the rounding of gradients added in another order).

    python examples/fork_towers.py [--experts 2] [--steps 30]

On a 2-core machine, forward overlaps; backward runs in the calling thread (one ``backward()``
call runs the CPU autograd graph one node at a time), so a training step gains less than a
forward: see benchmarks/threads.py.
"""

import argparse
import statistics
import time

import torch
from torch import nn

import paratrain


class Expert(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MoE(nn.Module):
    """Top-1 mixture of experts; ``mode`` is "fork_map" or "sequential"."""

    def __init__(self, d: int = 256, hidden: int = 1024, experts: int = 2, mode: str = "fork_map") -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList(Expert(d, hidden) for _ in range(experts))
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(dim=-1)
        choice = probs.argmax(dim=-1)
        routes = [torch.nonzero(choice == e).squeeze(1) for e in range(len(self.experts))]

        def run(e: int) -> torch.Tensor:  # one expert on its tokens, weighted by their gate probability
            return self.experts[e](x[routes[e]]) * probs[routes[e], e].unsqueeze(1)

        outs = paratrain.fork_map(run, range(len(self.experts)), backend="threads" if self.mode == "fork_map"
                                  else "sequential")
        y = torch.zeros_like(x)
        for idx, out in zip(routes, outs):
            y = y.index_add(0, idx, out)
        return x + y


def make_model(args: argparse.Namespace, mode: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, args.d), MoE(args.d, args.hidden, args.experts, mode), nn.Linear(args.d, 10))


def train(args: argparse.Namespace, mode: str) -> tuple[nn.Module, list[float], float]:
    model = make_model(args, mode)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(64, 10, generator=g)
    losses, times = [], []
    for _ in range(args.steps):
        x = torch.randn(args.tokens, 64, generator=g)
        y = (x @ teacher).argmax(dim=1)
        start = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return model, losses, statistics.median(times[2:] or times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--mode", choices=["both", "fork_map", "sequential"], default="both")
    args = p.parse_args()
    torch.set_num_threads(1)  # one intra-op thread per expert: the experts are the parallelism
    results = {}
    for mode in (["sequential", "fork_map"] if args.mode == "both" else [args.mode]):
        model, losses, step = train(args, mode)
        results[mode] = model
        print(f"{mode:10s}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps, "
              f"median step {step * 1e3:.1f} ms")
    if len(results) == 2:
        a, b = (dict(m.named_parameters()) for m in results.values())
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
        print(f"largest weight difference between the two runs: {diff:.2e}")


if __name__ == "__main__":
    main()
