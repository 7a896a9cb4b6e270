#!/usr/bin/env bash
# Sets up the venv (scripts/setup.sh) and runs the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PARATRAIN_VENV:-.venv}/bin/python" -m pytest -q "$@"
