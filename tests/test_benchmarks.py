"""Every script in ``benchmarks/`` runs in its smoke mode (``--smoke``: one round at tiny sizes), so
that a benchmark cannot break unnoticed between the times someone runs it for its numbers.

Each runs as a user runs it (``python benchmarks/<name>.py --smoke``), from an empty folder that is
not the checkout (nothing may depend on the working directory, nor be left in it), in its own
process group: past the limit the whole group (launched workers included) is SIGKILLed and the test
fails. A new script in ``benchmarks/`` is picked up by the glob; it needs a ``--smoke`` flag.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zygote
from pace import scaled

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
LIMIT_S = 180  # each takes 2-25 s on 2 idle cores; the rest is room for a loaded CI machine (times its pace)


def test_there_are_benchmarks() -> None:
    assert SCRIPTS, f"no benchmarks found in {ROOT / 'benchmarks'}"


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_benchmark_smoke(script: Path, tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # forked from the suite's zygote (tests/zygote.py: torch and paratrain imported once), run as python runs a script
    popen = zygote.ZygotePopen if zygote.enabled() else subprocess.Popen
    proc = popen([sys.executable, str(script), "--smoke"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=scaled(LIMIT_S))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"benchmarks/{script.name} --smoke ran past {LIMIT_S} s and was killed\n"
                    f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    finally:
        try:  # workers a failed run left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    assert proc.returncode == 0, (f"benchmarks/{script.name} --smoke failed ({proc.returncode})\n"
                                  f"stdout:\n{out[-3000:]}\nstderr:\n{err[-4000:]}")
    assert out.strip(), f"benchmarks/{script.name} --smoke printed nothing\nstderr:\n{err[-3000:]}"
    assert not list(tmp_path.iterdir()), f"benchmarks/{script.name} --smoke left files in its working " \
                                         f"directory: {sorted(p.name for p in tmp_path.iterdir())}"
