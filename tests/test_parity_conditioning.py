"""The equivalence tests measure paratrain, not chaos.

Every float32 problem they train (each test module's ``PROBLEMS``) is trained here by the plain
one-process reference with 1 and with 2 intra-op threads, and in float64. Two float32 runs that
differ only in rounding -- the thread count here, the ranks' gradient sums under paratrain -- must
end at least 10x inside the tolerance the test asserts, and so must float32 against float64 (a
bound on how far float32 rounding is amplified at all: the thread gap alone can be 0 where no
operation is big enough to be split). In float64, 1 vs 2 threads must agree to 1e-12, 100x inside
``FLOAT64_RTOL``. Run with ``-s`` to see the measured gaps. Single process, a few seconds.
"""

import os
import sys

import pytest
import torch

# The suites measured here live beside the code they test (tests/strategies, tests/ps, ...).
_HERE = os.path.dirname(os.path.abspath(__file__))
for _sub in ("strategies", "ps", "checkpoint", "nn"):
    sys.path.insert(0, os.path.join(_HERE, _sub))

import test_devices  # noqa: E402
import test_fsdp  # noqa: E402
import test_invariance  # noqa: E402
import test_pipeline  # noqa: E402
import test_ps  # noqa: E402
import test_resume  # noqa: E402
import test_syncbn  # noqa: E402
import test_tensor  # noqa: E402
from parity import FLOAT64_RTOL, num_threads, state_error  # noqa: E402

F64 = torch.float64
MODULES = [test_invariance, test_fsdp, test_tensor, test_pipeline, test_devices, test_ps, test_resume]
CASES = {f"{m.__name__}: {name}": problem for m in MODULES for name, problem in m.PROBLEMS.items()}


def _trained(problem, threads):
    with num_threads(threads):
        return problem.reference().state


@pytest.mark.parametrize("case", CASES)
def test_float32_reference_is_well_conditioned(case):
    p = CASES[case]
    one, two = _trained(p, 1), _trained(p, 2)
    exact, exact2 = _trained(p.replace(dtype=F64), 1), _trained(p.replace(dtype=F64), 2)
    threads, rounding, threads64 = state_error(two, one), state_error(one, exact), state_error(exact2, exact)
    print(f"\n{case}: float32 1 vs 2 threads {threads:.1e}, float32 vs float64 {rounding:.1e}, "
          f"float64 1 vs 2 threads {threads64:.1e} (rtol {p.rtol:g})")
    assert 10 * threads <= p.rtol, f"1 vs 2 threads differ by {threads:.1e}: rtol {p.rtol} is not 10x above it"
    assert 10 * rounding <= p.rtol, f"float32 vs float64 differ by {rounding:.1e}: rtol {p.rtol} is not 10x above it"
    assert 100 * threads64 <= FLOAT64_RTOL, f"float64, 1 vs 2 threads differ by {threads64:.1e}"


def test_syncbn_reference_is_well_conditioned():
    """SyncBatchNorm is compared with one BatchNorm over the whole batch: forward/backward passes,
    nothing trained. That reference with 1 vs 2 threads uses <= 1/10 of its tolerance
    (``assert_close``: |a - b| <= atol + rtol * |b|, element by element)."""
    for configs in test_syncbn.CONFIGS.values():
        for dim, momentum, n, dtype in configs:
            runs = []
            for threads in (1, 2):
                with num_threads(threads):
                    runs.append(test_syncbn._run(test_syncbn._make_bn(dim, momentum, dtype), dim, n, 1, 0, dtype))
            a, b = runs
            pairs = [*zip(a["out"], b["out"]), *zip(a["xgrad"], b["xgrad"])]
            pairs += [(a[k], b[k]) for k in ("wgrad", "bgrad", "running_mean", "running_var")]
            tol = test_syncbn.TOLERANCE[dtype]
            gap = max((x - y).abs().max().item() for x, y in pairs)
            used = max(((x - y).abs() / (tol["atol"] + tol["rtol"] * y.abs())).max().item() for x, y in pairs)
            print(f"\nsyncbn {dim}d momentum {momentum} batch {n} {dtype}: 1 vs 2 threads {gap:.1e} absolute, "
                  f"{used:.1%} of the tolerance")
            assert used <= 0.1
