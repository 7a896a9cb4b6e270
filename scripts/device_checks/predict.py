"""The device check: bench --predict's model against measured ddp."""

from __future__ import annotations

import os
import time
from typing import Any

from .base import CHECKS, CheckFailed, Result


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
    from paratrain.bench.predict import Workload, fit_link, predict, scheme_comm_s
    from paratrain.bench.scaling import measure_all_reduce, measured_link
    from paratrain.config import TrainConfig

    cores = os.cpu_count() or 1
    if mode == "gpu":
        sizes, model, batch, size, epochs = [4, 8], "resnet8", 32, 4096, 1
        sizes = [n for n in sizes if n <= cores] or [2]
    else:
        sizes, model, batch, size, epochs = [2], "mlp", 16, 1024, 1
    base = {"model": model, "data.dataset": "synthetic", "data.synthetic_size": size, "parallel.accelerator": "cpu"}
    t0 = time.monotonic()
    two = measure_all_reduce()
    link = measured_link(two)
    cell_timeout = max(30.0, budget / (2 + len(sizes)))
    compute = _bench_step_time(TrainConfig.load(None, {**base, "parallel.global_batch": batch}), "single", 1, epochs,
                               cell_timeout)
    cfg = TrainConfig.load(None, base)
    shapes = tuple(tuple(p.shape) for p in cfg.build_model().parameters() if p.requires_grad)
    print(f"{model} on synthetic ({size} samples), {batch} per worker, {cores} cores; link {link.describe()}; "
          f"single {compute * 1e3:.1f} ms a step ({time.monotonic() - t0:.0f} s so far)", flush=True)
    # compute alone and with n processes at once: what the model leaves out on one host (docs/predict.md)
    # bench --predict's own measurement on one host (30 s was too short for 4 at once on the H200 machine)
    from paratrain.bench import quick_spec
    from paratrain.bench.scaling import concurrent_compute

    t1 = time.monotonic()
    together = {n: t for (n, _), t in concurrent_compute(cfg, [(n, batch) for n in [1, *sizes]], quick_spec().threads,
                                                          10 if mode == "gpu" else 4, max(cell_timeout, budget / 2)).items()}
    print(f"the step's compute with n processes at once (ms): {[(n, round(t * 1e3, 1)) for n, t in together.items()]} "
          f"({time.monotonic() - t1:.0f} s)", flush=True)
    rows = []
    for n in sizes:
        measured = _bench_step_time(TrainConfig.load(None, {**base, "parallel.global_batch": n * batch}), "ddp", n,
                                    epochs, cell_timeout)
        row: dict[str, Any] = {"workers": n, "measured_ms": measured * 1e3}
        for exposed in (1.0, 0.0):
            (p,) = predict(Workload(compute, batch, shapes, exposed), link, ["all-reduce (ddp)"], [n])
            row[f"predicted_ms_exposed_{exposed:.0f}"] = p.step_s * 1e3
            row[f"error_pct_exposed_{exposed:.0f}"] = 100 * (p.step_s - measured) / measured
        # the gloo all-reduce itself at n processes: the link fitted at 2 against what n measure (issue 38 item 3)
        samples = measure_all_reduce(world=n, timeout=cell_timeout)
        row["all_reduce"] = samples
        row["grad_all_reduce_ms_at_2_fit"] = scheme_comm_s("all-reduce (ddp)", Workload(compute, batch, shapes, 1.0),
                                                           n, link) * 1e3
        try:
            own = fit_link(samples, n)
            row["link_fitted_at_n"] = own.describe()
            row["grad_all_reduce_ms_at_n_fit"] = scheme_comm_s("all-reduce (ddp)", Workload(compute, batch, shapes, 1.0),
                                                               n, own) * 1e3
        except ValueError as e:
            row["link_fitted_at_n"] = str(e)
        print(f"gloo all-reduce x{n} (bytes, ms): {[(int(b), round(t * 1e3, 3)) for b, t in samples]}; the gradients' "
              f"all-reduce by the 2-process link {row['grad_all_reduce_ms_at_2_fit']:.2f} ms, by a link fitted at "
              f"{n}: {row.get('grad_all_reduce_ms_at_n_fit', float('nan')):.2f} ms ({row['link_fitted_at_n']})",
              flush=True)
        # the same prediction with compute scaled by what n processes at once measured
        slow = together[n] / together[1]
        (q,) = predict(Workload(compute, batch, shapes, 1.0, together=((n, compute * slow),)), link,
                       ["all-reduce (ddp)"], [n])
        row["compute_slowdown"] = slow
        row["predicted_ms_concurrent"] = q.step_s * 1e3
        row["error_pct_concurrent"] = 100 * (q.step_s - measured) / measured
        print(f"x{n}: compute {slow:.2f}x alone with {n} at once; predicted with it {q.step_s * 1e3:.1f} ms "
              f"({row['error_pct_concurrent']:+.0f}%)", flush=True)
        rows.append(row)
        print(f"ddp x{n}: measured {measured * 1e3:.1f} ms; predicted {row['predicted_ms_exposed_1']:.1f} ms "
              f"({row['error_pct_exposed_1']:+.0f}%) all exposed, {row['predicted_ms_exposed_0']:.1f} ms "
              f"({row['error_pct_exposed_0']:+.0f}%) none", flush=True)
    summary = "; ".join(f"x{r['workers']}: measured {r['measured_ms']:.0f} ms, predicted "
                        f"{r['predicted_ms_exposed_1']:.0f} ms ({r['error_pct_exposed_1']:+.0f}%, exposed 1) / "
                        f"{r['predicted_ms_exposed_0']:.0f} ms ({r['error_pct_exposed_0']:+.0f}%, exposed 0) / "
                        f"{r['predicted_ms_concurrent']:.0f} ms ({r['error_pct_concurrent']:+.0f}%, compute "
                        f"{r['compute_slowdown']:.2f}x with {r['workers']} at once)"
                        for r in rows)
    return Result(f"{model}, {batch}/worker, gloo loopback: {summary}",
                  {"model": model, "batch_per_worker": batch, "cores": cores, "link": link.describe(),
                   "single_ms": compute * 1e3, "rows": rows, "all_reduce_2": two,
                   "compute_together_ms": {n: t * 1e3 for n, t in together.items()}})


CHECKS["predict"] = predict_check
