#!/usr/bin/env bash
# Creates (or reuses) a venv in the repository and installs paratrain with everything the tests need.
#   bash scripts/setup.sh        .venv       the pinned CPU build of torch (requirements.txt)
#   bash scripts/setup.sh cuda   .venv-cuda  PyPI's default CUDA build of torch (requirements-cuda.txt)
# A venv is rebuilt whenever its requirements or pyproject.toml change (their hash is stored).
set -euo pipefail
cd "$(dirname "$0")/.."
flavour=${1:-cpu}
case "$flavour" in
  cpu)  venv=${PARATRAIN_VENV:-.venv}; reqs=requirements.txt ;;
  cuda) venv=${PARATRAIN_CUDA_VENV:-.venv-cuda}; reqs=requirements-cuda.txt ;;
  *) echo "scripts/setup.sh: unknown flavour '$flavour': use cpu or cuda" >&2; exit 2 ;;
esac
key=$(cat "$reqs" requirements-common.txt pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$venv/.paratrain-key" ] || [ "$(cat "$venv/.paratrain-key")" != "$key" ]; then
  echo "setup: building $venv from $reqs" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$reqs" 2>&1 | { grep -v "^WARNING: Location" || true; } >&2
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >&2
  echo "$key" > "$venv/.paratrain-key"
fi
