#!/usr/bin/env bash
# Creates (or reuses) a venv in the repository with exactly the packages of its lock (requirements/,
# built by `bash scripts/lock.sh` from the requirements*.txt inputs), then installs paratrain itself:
#   bash scripts/setup.sh        .venv       the CPU build of torch (2.13.0+cpu), everything the tests,
#                                            the static checks and the docs need (lock-cpu.txt); paratrain -e
#   bash scripts/setup.sh cuda   .venv-cuda  PyPI's default CUDA build of torch (2.14.1) and the same
#                                            packages (lock-cuda.txt); paratrain -e
#   bash scripts/setup.sh floor  .venv-floor the oldest torch paratrain supports (2.11.0, a CUDA build) with
#                                            only what a bare GPU machine's python has (lock-floor.txt);
#                                            paratrain is not installed in it: it runs from the checkout
#                                            (PYTHONPATH), as scripts/device_check.sh runs it on a GPU machine
#   bash scripts/setup.sh tools  build/uv    uv alone (requirements/tools.txt), which installs the others
# A venv is synced again whenever its lock (or, but for floor, pyproject.toml) or python3 changes:
# their hash is stored in it. uv installs (hash-checked, from its cache after the first time: seconds);
# it reads the package sources of pip's configuration (`pip config list`: this machine's find-links
# hold the CPU build of torch), kept in build/uv/sources.
set -euo pipefail
cd -P "$(dirname "$0")/.."  # -P: the checkout this script is in, also when reached through a link (a docs page's folder)
flavour=${1:-cpu}
editable=1
case "$flavour" in
  cpu)   venv=${PARATRAIN_VENV:-.venv}; lock=requirements/lock-cpu.txt ;;
  cuda)  venv=${PARATRAIN_CUDA_VENV:-.venv-cuda}; lock=requirements/lock-cuda.txt ;;
  floor) venv=${PARATRAIN_FLOOR_VENV:-.venv-floor}; lock=requirements/lock-floor.txt; editable=0 ;;
  tools) ;;
  *) echo "scripts/setup.sh: unknown flavour '$flavour': use cpu, cuda, floor or tools" >&2; exit 2 ;;
esac

# uv itself, pinned with its hashes, in build/uv (pip's sources; rebuilt when tools.txt changes)
tools_key=$( (cat requirements/tools.txt; python3 --version) | sha256sum | cut -c1-16)
if [ "$(cat build/uv/.paratrain-key 2>/dev/null || true)" != "$tools_key" ]; then
  echo "setup: building build/uv from requirements/tools.txt" >&2
  rm -rf build/uv
  python3 -m venv build/uv
  build/uv/bin/pip install -q --disable-pip-version-check --no-deps --require-hashes -r requirements/tools.txt 2>&1 \
    | { grep -v "^WARNING: Location" || true; } >&2
  echo "$tools_key" > build/uv/.paratrain-key
fi
# pip's package sources, as uv arguments: --index-url/--extra-index-url/--find-links, one per line
python3 - > "build/uv/sources.$$" <<'EOF'  # one file per process: setup.sh may run in two at once
import shlex, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
seen = []
for line in out.splitlines():
    key, _, value = line.partition("=")
    option = key.rsplit(".", 1)[-1]
    if option in ("index-url", "extra-index-url", "find-links"):
        for item in shlex.split(value.strip().strip("'\"")):
            if (option, item) not in seen:
                seen.append((option, item))
for option, item in seen:
    print(f"--{option}\n{item}")
EOF
mv "build/uv/sources.$$" build/uv/sources
[ "$flavour" = tools ] && exit 0

inputs=("$lock" build/uv/.paratrain-key)
[ "$editable" = 1 ] && inputs+=(pyproject.toml)
# PARATRAIN_SETUP_BYTECODE=lazy (scripts/test.sh, which unsets PYTHONDONTWRITEBYTECODE): no .pyc at install; each
# module is compiled once, the first time a process imports it (most of the lock's files never are)
bytecode=${PARATRAIN_SETUP_BYTECODE:-install}
case "$bytecode" in
  install) compile=(--compile-bytecode) ;;
  lazy) compile=() ;;
  *) echo "scripts/setup.sh: PARATRAIN_SETUP_BYTECODE='$bytecode' is unknown: use install or lazy" >&2; exit 2 ;;
esac
key=$( (cat "${inputs[@]}"; python3 --version; echo "bytecode $bytecode") | sha256sum | cut -c1-16)
if [ "$(cat "$venv/.paratrain-key" 2>/dev/null || true)" != "$key" ]; then
  echo "setup: syncing $venv with $lock" >&2
  start=$SECONDS
  if [ "$("$venv/bin/python" --version 2>/dev/null || true)" != "$(python3 --version)" ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"  # with pip: tests build the wheel with `python -m pip wheel`
  fi
  mapfile -t sources < build/uv/sources
  # exactly the lock: what is missing installed, what differs replaced, what is not in it removed (pip is kept);
  # every file is hash-checked, so taking a pinned version from whichever source has it is safe
  # --compile-bytecode: uv writes no .pyc by default (pip does), and where PYTHONDONTWRITEBYTECODE is set
  # (this image sets it) every process would compile torch's modules again: 1 s more per import of torch,
  # which doubled the suite's time in a fresh clone (but see PARATRAIN_SETUP_BYTECODE above)
  build/uv/bin/uv pip sync --quiet ${compile[@]+"${compile[@]}"} --python "$venv/bin/python" --require-hashes \
    --index-strategy unsafe-best-match \
    ${sources[@]+"${sources[@]}"} "$lock"
  if [ "$editable" = 1 ]; then
    build/uv/bin/uv pip install --quiet --python "$venv/bin/python" --no-deps --no-build-isolation -e .
  fi
  echo "$key" > "$venv/.paratrain-key"
  echo "setup: $venv ready in $((SECONDS - start)) s" >&2
fi
