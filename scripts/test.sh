#!/usr/bin/env bash
# Sets up the venvs (scripts/setup.sh) and runs everything CI checks, in this order:
#   1. static checks: ruff over paratrain/, tests/, scripts/, benchmarks/ and docs/, mypy over paratrain/ (beside
#      step 2); zero findings;
#   2. the whole test suite on the pinned CPU build of torch;
#   3. the package as users install it: the sdist, the wheel built from it, installed (not -e) into a
#      fresh venv beside PyPI's default CUDA build of torch (versions from requirements/lock-cuda.txt),
#      then the smoke suite (pytest -m smoke) against the installed package, on the CPU, from a copy
#      of tests/ outside the checkout;
#   4. the floor: torch 2.11.0 (the oldest supported, a CUDA build, on the CPU) with only what a bare
#      GPU machine's python has, paratrain run from the checkout: import, one ddp x2 step, and
#      scripts/device_check.sh --dry-run (what a GPU machine's first run does, as CPU twins).
# Arguments go to the pytest runs (e.g. -x, -k NAME). PARATRAIN_SKIP_WHEEL=1 (or the older
# PARATRAIN_SKIP_CUDA_WHEEL=1) skips step 3, PARATRAIN_SKIP_FLOOR=1 step 4;
# `bash scripts/test.sh wheel [pytest arguments]` runs the set-up and step 3 alone.
# Each pytest run has a hard limit (the full suite takes about 12-22 minutes on 2 cores, the lab included): a hang ends
# as a failure with every thread's stack (tests/conftest.py), never as a stuck CI. `--foreground`
# keeps pytest in the caller's process group (a terminal's foreground group stays its own), and its
# stdin is /dev/null: nothing it starts (mpirun forwards stdin) may wait on input.
set -euo pipefail
cd "$(dirname "$0")/.."
only=
if [ "${1:-}" = wheel ]; then only=wheel; shift; fi
# the pytest runs use both cores (pytest-xdist; tests/conftest.py says what shares one worker: the lab's
# tests, a module's tests that share a trained fixture); PARATRAIN_TEST_WORKERS=0 runs them in one process
workers=(-n "${PARATRAIN_TEST_WORKERS:-2}")
[ "${PARATRAIN_TEST_WORKERS:-2}" = 0 ] && workers=(-p no:xdist)
stages=()  # "name seconds", printed at the end, failed or not
stage_start=$SECONDS
stage() {  # the stage that ends now took the time since the last call
  stages+=("$1 $((SECONDS - stage_start))")
  stage_start=$SECONDS
}
report() {
  local rc=$?
  rm -rf "${tmps[@]}"
  local ended=""
  [ "$rc" = 0 ] || ended="; $((SECONDS - stage_start)) s in the stage that failed"
  echo "== stages (s):$(printf ' %s,' "${stages[@]}" | sed 's/,$//')$ended; $SECONDS s in all, exit $rc"
}
tmps=()
trap report EXIT
bash scripts/setup.sh cpu
venv=${PARATRAIN_VENV:-.venv}
stage setup
if [ -z "$only" ]; then
echo "== static checks (ruff; mypy runs beside the suite: one core for a minute, mostly reading torch)"
"$venv/bin/ruff" check paratrain tests scripts benchmarks docs
mlog=$(mktemp); tmps+=("$mlog")
"$venv/bin/mypy" paratrain >"$mlog" 2>&1 </dev/null &
mypy_pid=$!
# the checkout's own .pyc once (PYTHONDONTWRITEBYTECODE, set on this image, would have every process compile it)
"$venv/bin/python" -m compileall -q -j 0 paratrain tests scripts benchmarks >/dev/null
stage static
echo "== full suite, torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
# test_smoke.py is for the CUDA wheel (below); the ten slowest tests are listed at the end
suite_rc=0
timeout --foreground -k 30 45m "$venv/bin/python" -m pytest -q "${workers[@]}" --durations=10 \
  --ignore=tests/test_smoke.py "$@" </dev/null || suite_rc=$?
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
echo "== mypy (exit $mypy_rc):"; cat "$mlog"
[ "$suite_rc" = 0 ] || exit "$suite_rc"
[ "$mypy_rc" = 0 ] || exit "$mypy_rc"
stage suite
echo "== docs: the site in strict mode, and every code block of its pages run"
bash scripts/docs.sh  # in $venv, whose lock holds the docs tools; about 2-4 minutes on 2 cores
stage docs
fi
if [ "$only" = wheel ] || { [ "${PARATRAIN_SKIP_WHEEL:-0}" != 1 ] && [ "${PARATRAIN_SKIP_CUDA_WHEEL:-0}" != 1 ]; }; then
  wtmp=$(mktemp -d); tmps+=("$wtmp")
  start=$SECONDS
  # sdist, then the wheel from the sdist (what PyPI would get), with the lock's setuptools: no index
  build/uv/bin/uv build --quiet --no-build-isolation --python "$venv/bin/python" --out-dir "$wtmp/dist" .
  wheel=$(echo "$wtmp"/dist/paratrain-*.whl)
  mapfile -t sources < build/uv/sources  # pip's package sources (scripts/setup.sh)
  build/uv/bin/uv venv --quiet --python python3 "$wtmp/venv"
  # the wheel's own requirements resolved as for a user (torch>=2.11: PyPI's CUDA build), pinned and
  # hash-checked by the lock; nothing from the checkout
  build/uv/bin/uv pip install --quiet --compile-bytecode --python "$wtmp/venv/bin/python" \
    --index-strategy unsafe-best-match \
    ${sources[@]+"${sources[@]}"} -c requirements/lock-cuda.txt "$wheel" pytest pytest-timeout pytest-xdist \
    torchvision  # its wheel for that torch, as users add it: tests/test_torchvision.py
  mkdir "$wtmp/t"  # tests/ (its helpers too) and the pytest settings, nothing else of the checkout
  tar -c --exclude=__pycache__ tests pyproject.toml | tar -x -C "$wtmp/t"
  mapfile -t smoke < <(grep -rl --include='*.py' 'pytest.mark.smoke' tests | sort)
  wpy=$wtmp/venv/bin/python
  (cd "$wtmp/t" && "$wpy" -c 'import paratrain, torch; assert "site-packages" in paratrain.__file__, paratrain.__file__
print("== the installed wheel:", paratrain.__file__, "| torch", torch.__version__, "cuda available:", torch.cuda.is_available())' \
    && "$wtmp/venv/bin/paratrain" --version)
  echo "== (sdist, wheel and the fresh venv: $((SECONDS - start)) s) smoke suite: ${smoke[*]}"
  stage wheel-install
  # PARATRAIN_TEST_ZYGOTE=0: every command a new interpreter, as users start it (the main suite forks
  # most of its `python -m paratrain` commands from one that imported torch: tests/zygote.py)
  (cd "$wtmp/t" && PARATRAIN_TEST_ZYGOTE=0 timeout --foreground -k 30 20m "$wpy" -m pytest -q "${workers[@]}" --durations=5 -m smoke \
    -p no:cacheprovider "${smoke[@]}" "$@" </dev/null)
  stage wheel-smoke
fi
if [ -z "$only" ] && [ "${PARATRAIN_SKIP_FLOOR:-0}" != 1 ]; then
  bash scripts/setup.sh floor
  fpy=${PARATRAIN_FLOOR_VENV:-.venv-floor}/bin/python
  ftmp=$(mktemp -d); tmps+=("$ftmp")
  echo "== floor: torch $("$fpy" -c 'import torch; print(torch.__version__)'), paratrain from the checkout"
  PYTHONPATH="$PWD" timeout --foreground -k 30 2m "$fpy" -c 'import paratrain; print("import paratrain:", paratrain.__version__)' </dev/null
  PYTHONPATH="$PWD" timeout --foreground -k 30 3m "$fpy" -m paratrain train --strategy ddp --nproc-per-node 2 --max-steps 1 \
    --no-progress --log-dir "$ftmp/ddp" </dev/null
  PYTHON="$fpy" timeout --foreground -k 30 5m bash scripts/device_check.sh --dry-run --python "$fpy" --out "$ftmp/device_check" </dev/null
  stage floor
fi
