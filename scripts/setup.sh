#!/usr/bin/env bash
# Creates (or reuses) .venv in the repository and installs paratrain with everything the tests need.
# The venv is rebuilt whenever requirements.txt or pyproject.toml change (their hash is stored).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PARATRAIN_VENV:-.venv}
key=$(cat requirements.txt pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$venv/.paratrain-key" ] || [ "$(cat "$venv/.paratrain-key")" != "$key" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r requirements.txt
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
  echo "$key" > "$venv/.paratrain-key"
fi
