"""The classic mistakes, named from what the probe saw in the runs.

Each check reads the merged observations of a run (:class:`RunView`): samples and fingerprints per
optimizer step, learning rates, parameters without gradient, the initial-weights checksum and
the unsynced BatchNorm layers, and turns a difference into a :class:`Finding` with a concrete fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Finding", "RunView", "diagnose"]

_PER_RANK_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(kw_only=True)
class Finding:
    cause: str
    """Short name of the mistake, e.g. 'BatchNorm not synced across ranks'."""
    message: str
    """What was seen and how to fix it."""
    fail: bool = True
    """False: a warning that does not by itself fail verification."""


@dataclass(kw_only=True)
class RunView:
    """One run's per-rank results merged: what the whole job did per optimizer step."""

    name: str
    world_size: int
    error: str | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    rank_states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    losses: list[float] | None = None
    samples: list[int] = field(default_factory=list)
    parallel: list[dict[str, Any]] = field(default_factory=list)
    """What each ``paratrain.Parallel`` built in the run ran (rank 0's; a built-in job's one, or
    those of a user's function): strategy, precision, accumulation, and whether the rank leads its
    data shard (the one whose samples count)."""
    fingerprints: list[list[float]] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    init_checksum: float | None = None
    unsynced_bn: list[str] = field(default_factory=list)
    dropout: list[str] = field(default_factory=list)
    """Dropout layers with p > 0 (their masks are drawn per rank)."""
    grad_norms: dict[str, float] = field(default_factory=dict)
    """Per parameter, its largest gradient norm at an optimizer step (rank 0's)."""

    def noise_gradients(self, ratio: float = 1e-7) -> set[str]:
        """Parameters whose gradient was rounding noise at every step (at most ``ratio`` of the
        largest): zero in exact arithmetic (an attention key bias, which softmax ignores)."""
        top = max(self.grad_norms.values(), default=0.0)
        return {name for name, norm in self.grad_norms.items() if top > 0 and norm <= ratio * top}

    @classmethod
    def merge(cls, name: str, world_size: int, ranks: list[dict[str, Any]] | None,
              error: str | None = None) -> "RunView":
        view = cls(name=name, world_size=world_size, error=error)
        if not ranks:
            return view
        ranks = sorted(ranks, key=lambda r: r["rank"])
        failed = next((r for r in ranks if r.get("error")), None)
        if failed is not None and view.error is None:
            view.error = f"rank {failed['rank']} failed: {failed['error']}"
        r0 = ranks[0]
        view.state, view.rank_states = r0["state"], [r["state"] for r in ranks]
        curves = [r["losses"] for r in ranks if r["losses"]]
        if curves:  # an entry's losses are per rank: the job's loss is their mean
            view.losses = [sum(v) / len(v) for v in zip(*curves)]
        # The samples of a step: those of one rank per data shard, the one place that rule lives
        # for built-in jobs and users' functions alike. Ranks whose Parallel shares one shard's
        # batches (tensor, pipeline) each see all of it; a rank without one reads its own.
        readers = [r for r in ranks if (r.get("parallel") or [{}])[-1].get("data_parallel_leader", True)]
        steps = [r["probe"]["steps"] for r in readers or ranks]
        n = min(len(s) for s in steps)
        view.samples = [sum(s[i]["samples"] for s in steps) for i in range(n)]
        view.parallel = r0.get("parallel", [])
        view.fingerprints = [sorted(fp for s in steps for fp in s[i]["fingerprints"]) for i in range(n)]
        view.lrs = [steps[0][i]["lr"] for i in range(n)]
        view.unused = r0["probe"]["unused"] or []
        view.init_checksum = r0["probe"]["init_checksum"]
        view.unsynced_bn = r0["unsynced_bn"]
        view.dropout = r0.get("dropout", [])
        view.grad_norms = r0["probe"].get("grad_norms", {})
        return view


def _first_data_mismatch(a: RunView, b: RunView) -> int | None:
    for i, (fa, fb) in enumerate(zip(a.fingerprints, b.fingerprints)):
        if len(fa) != len(fb) or not torch.allclose(torch.tensor(fa, dtype=torch.float64),
                                                    torch.tensor(fb, dtype=torch.float64), rtol=1e-6, atol=1e-9):
            return i
    return None


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _batch(ref: RunView, run: RunView) -> list[Finding]:
    if not ref.samples or not run.samples or ref.samples[0] == run.samples[0] or not ref.samples[0]:
        return []
    b1, bn, n = ref.samples[0], run.samples[0], run.world_size
    k = bn / b1
    out = [Finding(cause="effective batch changed with world size",
                   message=f"{b1} samples per optimizer step at world size 1 but {bn} at world size {n} "
                           f"({bn // n} per worker): the per-worker batch stayed fixed, so the global batch grew "
                           f"x{k:g}. "
                           f"Keep the global batch and split it: per-worker batch = global batch // world size "
                           f"(paratrain.Parallel(global_batch={b1}) and pt.train_loader do this)")]
    lr1, lrn = max(ref.lrs or [0.0]), max(run.lrs or [0.0])
    if k > 1 and lr1 > 0 and abs(lrn - lr1) <= 1e-9 * lr1:
        out.append(Finding(cause="learning rate not scaled when the batch was",
                           message=f"the batch grew x{k:g} but the learning rate stayed {lr1:g}, so every epoch makes "
                                   f"x{k:g} fewer updates of the same size (a known case: 4-GPU DDP fell from 27% to "
                                   f"14% accuracy this way). Keep the "
                                   f"global batch, or scale the lr to {lr1 * k:g} with warmup (linear scaling rule, "
                                   f"Goyal et al. 2017; in paratrain: --base-batch {b1} --warmup-steps N)"))
    elif k > 1 and lr1 > 0 and abs(lrn - k * lr1) <= 1e-6 * k * lr1:
        out.append(Finding(cause="learning rate scaled with the batch", fail=False,
                           message=f"the lr was scaled x{k:g} with the batch (linear scaling rule): the result is "
                                   "expected to differ; compare at a fixed global batch to verify the parallelism"))
    return out


def diagnose(ref: RunView, runs: list[RunView], failed: set[str], repeat: RunView | None = None) -> list[Finding]:
    """Findings for the world-size-N run(s) in ``runs`` against the world-size-1 ``ref``.

    ``failed`` names the runs whose comparison with ``ref`` failed; ``repeat`` is a second
    world-size-1 run over the same global batches (a repeat or the accumulation run).
    """
    out: list[Finding] = []
    for run in runs:
        if run.error:
            out.append(Finding(cause=f"the {run.name} run failed", message=run.error))
        batch = _batch(ref, run)
        out += batch
        if run.world_size > 1 and run.unsynced_bn and run.name in failed:
            m = run.samples[0] // run.world_size if run.samples else "its"
            layers = f"{len(run.unsynced_bn)} BatchNorm layer(s) ({_names(run.unsynced_bn)})"
            out.append(Finding(cause="BatchNorm not synced across ranks",
                               message=f"{layers} normalise each worker's micro-batch ({m} samples) instead of the "
                                       f"global batch ({run.samples[0] if run.samples else '?'}), so the gradients "
                                       "differ from one process's: use --sync-bn (parallel.sync_batchnorm = true, "
                                       "paratrain.Parallel(sync_batchnorm=True)) or "
                                       "nn.SyncBatchNorm.convert_sync_batchnorm"))
        if run.world_size > 1 and run.dropout and run.name in failed:
            out.append(Finding(cause="dropout masks differ across world sizes",
                               message=f"{len(run.dropout)} dropout layer(s) ({_names(run.dropout)}) draw their masks "
                                       "from each rank's random stream over its share of the batch, so no world size "
                                       "can draw world size 1's masks and the parameters differ; verify with dropout "
                                       "off (p=0, e.g. a config's hidden_dropout_prob=0) to check everything else",
                               fail=False))
        if not batch and not run.error:
            step = _first_data_mismatch(ref, run)
            if step is not None:
                out.append(Finding(cause="data order differs across world sizes",
                                   message=f"optimizer step {step} trained on different samples at world size "
                                           f"{run.world_size} than at world size 1 (same count, {ref.samples[step]}): "
                                           "split one seeded global order by rank (paratrain's train_loader does; "
                                           "DistributedSampler(seed=...) with per-worker batch = global // world "
                                           "does too)"))
        for r, state in enumerate([] if run.error else run.rank_states[1:], start=1):
            bad = [k for k, v in state.items() if not k.endswith(_PER_RANK_BUFFERS) and v.is_floating_point()
                   and not torch.allclose(v, run.state[k], rtol=1e-6, atol=1e-8)]
            if bad:
                out.append(Finding(cause="ranks hold different weights",
                                   message=f"at world size {run.world_size}, rank {r} ends with other values "
                                           f"than rank 0 for {_names(bad)}: gradients are not averaged over all "
                                           "ranks (a model not wrapped in DDP, or a step taken outside the "
                                           "synchronised path)"))
                break
    if repeat is not None and not repeat.error:
        step = _first_data_mismatch(ref, repeat)
        if step is not None:
            out.append(Finding(cause="data order not seeded",
                               message=f"two runs at world size 1 ({ref.name}, {repeat.name}) trained on different "
                                       f"samples at optimizer step {step}: seed the shuffling (DataLoader(generator="
                                       "torch.Generator().manual_seed(seed)), DistributedSampler(seed=...), or "
                                       "paratrain's train_loader)"))
        if ref.init_checksum is not None and repeat.init_checksum is not None and \
                abs(ref.init_checksum - repeat.init_checksum) > 1e-9 * max(1.0, abs(ref.init_checksum)):
            out.append(Finding(cause="model initialisation not seeded",
                               message=f"two runs at world size 1 ({ref.name}, {repeat.name}) started from different "
                                       "weights: call torch.manual_seed(seed) (paratrain.seed_everything) before "
                                       "building the model, with the same seed on every rank"))
    if ref.unused:
        n_failed = any(r.error for r in runs if r.world_size > 1)
        out.append(Finding(cause="parameters unused in backward", fail=n_failed,
                           message=f"{_names(ref.unused)} got no gradient in the first step: DDP at world size > 1 "
                                   "fails on them ('Expected to have finished reduction') unless "
                                   "find_unused_parameters=True (--set parallel.ddp.find_unused_parameters=true); "
                                   "better, remove them or use them in forward"))
    return out
