#!/usr/bin/env bash
# Sets up the venvs (scripts/setup.sh) and runs everything CI checks:
#   1. static checks: ruff over paratrain/, tests/, scripts/, benchmarks/ and docs/, mypy over paratrain/ (beside
#      step 2); zero findings;
#   2. the whole test suite on the pinned CPU build of torch;
#   3. the docs: every code block of its pages runs, a page per test of the suite (tests/docs/test_doc_pages.py), and
#      the site is built in strict mode beside the suite (scripts/docs.sh --site);
#   4. the package as users install it: the sdist, the wheel built from it, installed (not -e) into a
#      fresh venv beside PyPI's default CUDA build of torch (versions from requirements/lock-cuda.txt),
#      then the smoke suite (pytest -m smoke) against the installed package, on the CPU, from a copy
#      of tests/ outside the checkout;
#   5. the floor: torch 2.11.0 (the oldest supported, a CUDA build, on the CPU) with only what a bare
#      GPU machine's python has, paratrain run from the checkout: import, one ddp x2 step, and
#      scripts/device_check.sh --dry-run (what a GPU machine's first run does, as CPU twins).
# What leaves a core idle runs beside what does not: the floor's and the wheel's venvs (niced: mostly unpacking) and
# the docs site (Sphinx: one core for ~20 s) are built during the suite, and the floor (its dry run in two halves at
# once, each one process at a time, most of it) runs during the smoke suite (which is niced: the floor is the longer
# chain), its output printed when it ends. Each stage's own seconds are printed at the
# end ("== stages (s): ...", the background ones marked "beside").
# Arguments go to the pytest runs (e.g. -x, -k NAME). PARATRAIN_SKIP_WHEEL=1 (or the older
# PARATRAIN_SKIP_CUDA_WHEEL=1) skips step 4, PARATRAIN_SKIP_FLOOR=1 step 5;
# `bash scripts/test.sh wheel [pytest arguments]` runs the set-up and step 4 alone, `bash scripts/test.sh
# floor` the set-up and step 5.
# Each pytest run has a hard limit (the full suite takes about 14-15 minutes on 2 cores, the lab included): a hang ends
# as a failure with every thread's stack (tests/conftest.py), never as a stuck CI. `--foreground`
# keeps pytest in the caller's process group (a terminal's foreground group stays its own), and its
# stdin is /dev/null: nothing it starts (mpirun forwards stdin) may wait on input.
set -euo pipefail
cd "$(dirname "$0")/.."
# .pyc files: each module's is written by the first process that imports it. This image sets PYTHONDONTWRITEBYTECODE,
# which would have every process compile what it imports again (1 s more per import of torch), and compiling every
# file of every venv at install instead (uv's --compile-bytecode) took 66 core-s before anything ran, for the .venv
# alone, most of it for files no test imports
unset PYTHONDONTWRITEBYTECODE
export PARATRAIN_SETUP_BYTECODE=lazy  # scripts/setup.sh
only=
case "${1:-}" in wheel|floor) only=$1; shift ;; esac
want() {  # does this run include step $1 (wheel, floor, or the main ones: main)
  case "$1" in
    main) [ -z "$only" ] ;;
    wheel) [ "$only" = wheel ] || { [ -z "$only" ] && [ "${PARATRAIN_SKIP_WHEEL:-0}" != 1 ] && [ "${PARATRAIN_SKIP_CUDA_WHEEL:-0}" != 1 ]; } ;;
    floor) [ "$only" = floor ] || { [ -z "$only" ] && [ "${PARATRAIN_SKIP_FLOOR:-0}" != 1 ]; } ;;
  esac
}
# the pytest runs use every core (pytest-xdist; tests/conftest.py says what shares one worker: the lab's
# tests, a module's tests that share a trained fixture); PARATRAIN_TEST_WORKERS=0 runs them in one process.
# One worker per core computes, and one more runs only the tests marked `waits` (a timeout or a signal waited out:
# ~300 s of a worker's time for ~40 core-s), beside them: with two workers, both waiting at once left the cores
# idle for minutes of the run. Three that all took any test gained nothing: each compute-bound test got 2/3 of a
# core. The tests' real time limits get the share each has (tests/pace.py: share)
nworkers=${PARATRAIN_TEST_WORKERS:-$(($(nproc) + 1))}
workers=(-n "$nworkers")
[ "$nworkers" = 0 ] && workers=(-p no:xdist)
stages=()  # "name seconds", printed at the end, failed or not
stage_start=$SECONDS
stage() {  # the stage that ends now took the time since the last call
  stages+=("$1 $((SECONDS - stage_start))")
  stage_start=$SECONDS
}
tmps=()
jobs_=()  # background steps: each its own process group, killed if the run ends first
report() {
  local rc=$?
  local pid
  for pid in ${jobs_[@]+"${jobs_[@]}"}; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  rm -rf ${tmps[@]+"${tmps[@]}"}
  local ended=""
  [ "$rc" = 0 ] || ended="; $((SECONDS - stage_start)) s in the stage that failed"
  echo "== stages (s):$(printf ' %s,' "${stages[@]}" | sed 's/,$//')$ended; $SECONDS s in all, exit $rc"
}
trap report EXIT
beside() {  # beside [--nice] NAME LOG COMMAND...: run COMMAND (a function too) in the background, in its own
  # process group (niced: it yields the cores to what runs in front); its output goes to LOG, its seconds
  # to LOG.s; `joined NAME` waits for it
  local nice=0; [ "$1" = --nice ] && { nice=1; shift; }
  local name=$1 log=$2; shift 2
  set -m  # job control just for this fork: the job gets its own process group (killable as a whole)
  ( [ "$nice" = 1 ] && renice -n 10 -p "$BASHPID" >/dev/null
    start=$SECONDS; trap 'echo "$((SECONDS - start))" > "$log.s"' EXIT
    "$@" ) >"$log" 2>&1 </dev/null &  # not `"$@" || ...`: that would turn off set -e inside it
  set +m
  jobs_+=("$!")
  eval "pid_$name=$! log_$name=$log"
}
joined() {  # joined NAME TITLE: wait for NAME, print its output under TITLE, add its stage; fail with it
  local name=$1 rc=0 pid log
  pid=$(eval echo "\$pid_$name"); log=$(eval echo "\$log_$name")
  wait "$pid" || rc=$?
  echo "== $2 (beside the others; exit $rc):"; cat "$log"
  stages+=("$name $(cat "$log.s" 2>/dev/null || echo '?') beside")
  return "$rc"
}
bash scripts/setup.sh cpu
venv=${PARATRAIN_VENV:-.venv}
# the machine's pace (tests/pace.py: a fresh import of torch against the reference machine's), measured once
# here, before anything runs beside: the suite's and the floor's limits and budgets scale with the machine, not
# with this script's own background work
PARATRAIN_TEST_PACE=${PARATRAIN_TEST_PACE:-$("$venv/bin/python" tests/pace.py)}
export PARATRAIN_TEST_PACE
echo "== this machine's pace: $PARATRAIN_TEST_PACE (1 = the reference 2-core machine; limits and budgets scale with it)"
stage setup

wtmp=$(mktemp -d); tmps+=("$wtmp")
wheel_venv() {  # sdist, then the wheel from the sdist (what PyPI would get), with the lock's setuptools: no index
  build/uv/bin/uv build --quiet --no-build-isolation --python "$venv/bin/python" --out-dir "$wtmp/dist" .
  local wheel sources
  wheel=$(echo "$wtmp"/dist/paratrain-*.whl)
  mapfile -t sources < build/uv/sources  # pip's package sources (scripts/setup.sh)
  build/uv/bin/uv venv --quiet --python python3 "$wtmp/venv"
  # the wheel's own requirements resolved as for a user (torch>=2.11: PyPI's CUDA build), pinned and
  # hash-checked by the lock; nothing from the checkout
  build/uv/bin/uv pip install --quiet --python "$wtmp/venv/bin/python" \
    --index-strategy unsafe-best-match \
    ${sources[@]+"${sources[@]}"} -c requirements/lock-cuda.txt "$wheel" pytest pytest-timeout pytest-xdist \
    torchvision  # its wheel for that torch, as users add it: tests/test_torchvision.py
  mkdir "$wtmp/t"  # tests/ (its helpers too) and the pytest settings, nothing else of the checkout
  tar -c --exclude=__pycache__ tests pyproject.toml | tar -x -C "$wtmp/t"
  (cd "$wtmp/t" && "$wtmp/venv/bin/python" -c 'import paratrain, torch; assert "site-packages" in paratrain.__file__, paratrain.__file__
print("the installed wheel:", paratrain.__file__, "| torch", torch.__version__, "cuda available:", torch.cuda.is_available())' \
    && "$wtmp/venv/bin/paratrain" --version)
  (cd "$wtmp/t" && warm "$wtmp/venv/bin/python")  # the installed paratrain's
}
warm() {  # warm PYTHON: the .pyc of what every command imports (torch, its compiler front end, which any optimizer
  # imports), written now, beside the suite, not by the first commands of the smoke suite or the floor at the end
  "$1" -c 'import torch, torch._dynamo, paratrain.cli.main, paratrain.cli.train, paratrain.loop.train'
}
floor_venv() {
  bash scripts/setup.sh floor
  PYTHONPATH="$PWD" warm "$fpy"  # the checkout's paratrain, as the floor runs it
}
wheel_smoke() {
  local smoke
  mapfile -t smoke < <(grep -rl --include='*.py' 'pytest.mark.smoke' tests | sort)
  echo "== wheel: smoke suite on the installed package: ${smoke[*]}"
  # its `python -m paratrain` commands fork from one that imported the installed package and torch
  # (tests/zygote.py), as in the main suite; one of them starts a new interpreter (tests/test_smoke.py)
  (cd "$wtmp/t" && ${smoke_nice[@]+"${smoke_nice[@]}"} timeout --foreground -k 30 20m "$wtmp/venv/bin/python" -m pytest -q \
    "${workers[@]}" --durations=5 -m smoke -p no:cacheprovider "${smoke[@]}" "$@" </dev/null)
}
ftmp=$(mktemp -d); tmps+=("$ftmp")
fpy=${PARATRAIN_FLOOR_VENV:-.venv-floor}/bin/python
floor_run() {
  # the dry run in two halves at once (--only; each one process at a time, most of it): the whole dry run alone
  # kept one core idle for the last ~90 s of CI. The second half starts first; the first follows the import and the
  # ddp step
  local budget rc=0 other halves
  # the dry run's own budget (scripts/device_driver/plan.py: on a quiet 2-core machine) with this machine's room
  # (tests/pace.py: the pace above)
  budget=$("$venv/bin/python" tests/pace.py "$(PYTHONPATH=scripts "$venv/bin/python" -c \
    'from device_driver.plan import DEFAULT_DRY_BUDGET; print(DEFAULT_DRY_BUDGET)')")
  # the halves, ~80 s each here: the second's steps as named, the first's every other (a new step included)
  mapfile -t halves < <(PYTHONPATH=scripts "$venv/bin/python" -c 'from device_driver.plan import STEPS
second = ["compile", "bench_quick", "predict", "seed_table", "selftest"]
print(",".join(s.name for s in STEPS if s.name not in second)); print(",".join(second))')
  floor_dry "$budget" "$ftmp/device_check-2" "${halves[1]}" >"$ftmp/device_check-2.log" 2>&1 &
  other=$!
  echo "torch $("$fpy" -c 'import torch; print(torch.__version__)'), paratrain from the checkout"
  PYTHONPATH="$PWD" timeout --foreground -k 30 2m "$fpy" -c 'import paratrain; print("import paratrain:", paratrain.__version__)' </dev/null \
    && PYTHONPATH="$PWD" timeout --foreground -k 30 3m "$fpy" -m paratrain train --strategy ddp --nproc-per-node 2 \
    --max-steps 1 --no-progress --log-dir "$ftmp/ddp" </dev/null \
    && floor_dry "$budget" "$ftmp/device_check" "${halves[0]}" || rc=$?
  wait "$other" || rc=$?
  echo "== the dry run's other half:"; cat "$ftmp/device_check-2.log"
  [ "$rc" = 0 ] || return "$rc"
  # issue 38: the dry run runs the LM row's CPU twin (a step skipped for its budget is not a failure there)
  "$venv/bin/python" -c 'import json, sys
lm = [s for s in json.load(open(sys.argv[1]))["steps"] if s["name"] == "lm"]
sys.exit(None if lm and lm[0]["details"].get("lm") else f"the dry run ran no LM rows: {lm and lm[0]['summary']}")' \
    "$ftmp/device_check/device_check.json"
}
floor_dry() {  # floor_dry BUDGET OUT STEPS: scripts/device_check.sh --dry-run of those steps on the floor
  PYTHON="$fpy" timeout --foreground -k 30 8m bash scripts/device_check.sh --dry-run --budget "$1" \
    --python "$fpy" --out "$2" --only "$3" </dev/null
}

if [ "$only" = wheel ]; then
  wheel_venv; stage wheel-install
  wheel_smoke "$@"; stage wheel-smoke
  exit 0
fi
if [ "$only" = floor ]; then
  floor_venv; stage floor-setup
  floor_run; stage floor
  exit 0
fi

echo "== static checks (ruff; mypy runs beside the suite: one core for ~35 s, mostly reading torch)"
"$venv/bin/ruff" check paratrain tests scripts benchmarks docs
mlog=$(mktemp); tmps+=("$mlog")
"$venv/bin/mypy" paratrain >"$mlog" 2>&1 </dev/null &
mypy_pid=$!
stage static
# the other venvs while the suite runs (niced: the suite's timing is the suite's)
want wheel && beside --nice wheel_install "$wtmp/wheel-install.log" wheel_venv
want floor && beside --nice floor_setup "$ftmp/floor-setup.log" floor_venv
beside docs_site "$wtmp/docs-site.log" bash scripts/docs.sh --site  # not niced: 5 min for ~30 core-s; blocks: in the suite

echo "== full suite, torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
# test_smoke.py is for the CUDA wheel (below); the ten slowest tests are listed at the end
suite_rc=0
# PARATRAIN_TEST_JUNIT=FILE keeps every test's time there (JUnit XML), to see where the suite's time goes;
# PARATRAIN_TEST_CPU_LOG=FILE each test's CPU seconds, its processes included (tests/cpuaccount.py; as root)
junit=(); [ -n "${PARATRAIN_TEST_JUNIT:-}" ] && junit=(--junitxml "$PARATRAIN_TEST_JUNIT")
timeout --foreground -k 30 45m "$venv/bin/python" -m pytest -q "${workers[@]}" --durations=10 \
  ${junit[@]+"${junit[@]}"} --ignore=tests/test_smoke.py "$@" </dev/null || suite_rc=$?
if [ -s "${PARATRAIN_TEST_CPU_LOG:-}" ]; then  # tests/cpuaccount.py: each test's CPU, its processes included
  echo "== the ten tests that took the most CPU (core-seconds; wall seconds; of $(awk '{s += $2} END {printf "%.0f", s}' \
    "$PARATRAIN_TEST_CPU_LOG") core-s in all):"
  sort -k2 -rn "$PARATRAIN_TEST_CPU_LOG" | awk 'NR <= 10 {printf "%8s %8s  %s\n", $2, $1, $4}'  # not head: SIGPIPE
fi
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
echo "== mypy (exit $mypy_rc):"; cat "$mlog"
[ "$suite_rc" = 0 ] || exit "$suite_rc"
[ "$mypy_rc" = 0 ] || exit "$mypy_rc"
stage suite

if want floor; then
  joined floor_setup "floor: the venv (scripts/setup.sh floor)"
  beside floor "$ftmp/floor.log" floor_run  # beside the smoke suite
fi
joined docs_site "docs: the site in strict mode (scripts/docs.sh --site)"
if want wheel; then
  joined wheel_install "wheel: sdist, wheel and a fresh venv with PyPI's CUDA build"
  # the floor beside is the longer chain: the smoke suite yields it the cores. Without that, its two workers left
  # the floor half a core, and the floor ran 90 s on alone after them (205 s in all)
  smoke_nice=(); want floor && smoke_nice=(nice -n 10)
  wheel_smoke "$@"
  stage wheel-smoke
fi
if want floor; then
  joined floor "floor: torch 2.11 (a CUDA build on the CPU), paratrain from the checkout"
fi
