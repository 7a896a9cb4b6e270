#!/usr/bin/env bash
# Sets up the venvs (scripts/setup.sh) and runs everything CI checks, in this order:
#   1. static checks over paratrain/: ruff (pyflakes rules and more) and mypy, zero findings;
#   2. the whole test suite on the pinned CPU build of torch;
#   3. the smoke suite (pytest -m smoke) on PyPI's default CUDA build of torch, on the CPU;
#   4. the floor: torch 2.11.0 (the oldest supported, a CUDA build, on the CPU) with only what a bare
#      GPU machine's python has, paratrain run from the checkout: import, one ddp x2 step, and
#      scripts/device_check.sh --dry-run (what a GPU machine's first run does, as CPU twins).
# Arguments go to both pytest runs (e.g. -x, -k NAME). PARATRAIN_SKIP_CUDA_WHEEL=1 skips step 3,
# PARATRAIN_SKIP_FLOOR=1 step 4.
# Each pytest run has a hard limit (the full suite takes about 10 minutes on 2 cores): a hang ends
# as a failure with every thread's stack (tests/conftest.py), never as a stuck CI. `--foreground`
# keeps pytest in the caller's process group (a terminal's foreground group stays its own), and its
# stdin is /dev/null: nothing it starts (mpirun forwards stdin) may wait on input.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh cpu
venv=${PARATRAIN_VENV:-.venv}
echo "== static checks (ruff, mypy)"
"$venv/bin/ruff" check paratrain
"$venv/bin/mypy" paratrain
echo "== full suite, torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
timeout --foreground -k 30 45m "$venv/bin/python" -m pytest -q --durations=25 --ignore=tests/test_smoke.py "$@" </dev/null  # test_smoke.py is for the CUDA wheel (below)
echo "== docs: the site in strict mode, and every code block of its pages run"
bash scripts/docs.sh  # docs/requirements.txt into $venv; about 2-4 minutes on 2 cores
if [ "${PARATRAIN_SKIP_CUDA_WHEEL:-0}" != 1 ]; then
  bash scripts/setup.sh cuda
  cvenv=${PARATRAIN_CUDA_VENV:-.venv-cuda}
  echo "== smoke suite, torch $("$cvenv/bin/python" -c 'import torch; print(torch.__version__, "cuda available:", torch.cuda.is_available())')"
  timeout --foreground -k 30 20m "$cvenv/bin/python" -m pytest -q -m smoke -p no:cacheprovider "$@" </dev/null
fi
if [ "${PARATRAIN_SKIP_FLOOR:-0}" != 1 ]; then
  bash scripts/setup.sh floor
  fpy=${PARATRAIN_FLOOR_VENV:-.venv-floor}/bin/python
  ftmp=$(mktemp -d)
  trap 'rm -rf "$ftmp"' EXIT
  echo "== floor: torch $("$fpy" -c 'import torch; print(torch.__version__)'), paratrain from the checkout"
  PYTHONPATH="$PWD" timeout --foreground -k 30 2m "$fpy" -c 'import paratrain; print("import paratrain:", paratrain.__version__)' </dev/null
  PYTHONPATH="$PWD" timeout --foreground -k 30 3m "$fpy" -m paratrain train --strategy ddp --nproc-per-node 2 --max-steps 1 \
    --no-progress --log-dir "$ftmp/ddp" </dev/null
  PYTHON="$fpy" timeout --foreground -k 30 5m bash scripts/device_check.sh --dry-run --python "$fpy" --out "$ftmp/device_check" </dev/null
fi
