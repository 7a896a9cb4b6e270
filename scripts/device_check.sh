#!/usr/bin/env bash
# Check a GPU machine in one budget (default 7 minutes): paratrain selftest plus the GPU-only checks
# (nccl, fsdp + bf16, fp16 + CUDA GradScaler, SyncBatchNorm, torch.compile), bench --quick, and the
# loader and predictor measurements; everything under --out (default $OUT, else runs/device_check).
#   bash scripts/device_check.sh [--budget S] [--out DIR] [--only STEP,...]      on the GPU machine
#   bash scripts/device_check.sh --dry-run [--python PY]                          its CPU twins, here
# Installs nothing: paratrain runs from this checkout (PYTHONPATH) on the machine's own python
# ($PYTHON, default python3; --python picks the one that runs the steps). See scripts/device_check.py.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$root/scripts/device_check.py" "$@"
