#!/usr/bin/env bash
# Creates (or reuses) a venv in the repository and installs paratrain with everything the tests need.
#   bash scripts/setup.sh        .venv       the pinned CPU build of torch (requirements.txt)
#   bash scripts/setup.sh cuda   .venv-cuda  PyPI's default CUDA build of torch (requirements-cuda.txt)
#   bash scripts/setup.sh floor  .venv-floor the oldest torch paratrain supports (2.11.0, a CUDA build) with
#                                            only what a bare GPU machine's python has (requirements-floor.txt);
#                                            paratrain is not installed in it: it runs from the checkout
#                                            (PYTHONPATH), as scripts/device_check.sh runs it on a GPU machine
# A venv is rebuilt whenever its requirements (or, but for floor, pyproject.toml) change (their hash is stored).
set -euo pipefail
cd "$(dirname "$0")/.."
flavour=${1:-cpu}
case "$flavour" in
  cpu)   venv=${PARATRAIN_VENV:-.venv}; reqs=(requirements.txt requirements-common.txt pyproject.toml) ;;
  cuda)  venv=${PARATRAIN_CUDA_VENV:-.venv-cuda}; reqs=(requirements-cuda.txt requirements-common.txt pyproject.toml) ;;
  floor) venv=${PARATRAIN_FLOOR_VENV:-.venv-floor}; reqs=(requirements-floor.txt) ;;
  *) echo "scripts/setup.sh: unknown flavour '$flavour': use cpu, cuda or floor" >&2; exit 2 ;;
esac
key=$(cat "${reqs[@]}" | sha256sum | cut -c1-16)
if [ ! -f "$venv/.paratrain-key" ] || [ "$(cat "$venv/.paratrain-key")" != "$key" ]; then
  echo "setup: building $venv from ${reqs[0]}" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "${reqs[0]}" 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
  if [ "$flavour" != floor ]; then
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >&2
  fi
  echo "$key" > "$venv/.paratrain-key"
fi
