#!/usr/bin/env bash
# Check a GPU machine in one budget (default 9 minutes): the language-model rows (GPT-2 124M: tokens/s,
# MFU; bf16, fp16 and fp8), paratrain selftest plus the GPU-only checks (nccl, fsdp + bf16, fp16 + CUDA
# GradScaler, SyncBatchNorm, torch.compile), bench --quick, and the loader and predictor measurements;
# everything under --out (default $OUT, else runs/device_check).
#   bash scripts/device_check.sh [--budget S] [--out DIR] [--only STEP,...]      on the GPU machine
#   bash scripts/device_check.sh --dry-run [--python PY]                          its CPU twins, here
# Installs nothing: paratrain runs from this checkout (PYTHONPATH) on the machine's own python
# ($PYTHON, default python3; --python picks the one that runs the steps). See scripts/device_check.py.
# A machine without network or torchao: `bash scripts/device_check.sh --bring DIR` (here) unpacks the
# pinned torchao wheel (requirements/lock-cuda.txt) into DIR/site, an ignored folder to carry along with
# the checkout (e.g. build/device-site); the check puts build/device-site/site on PYTHONPATH when it is there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ "${1:-}" = --bring ]; then
  dir=${2:-$root/build/device-site}
  version=$(sed -n 's/^torchao==\([^ ]*\).*/\1/p' "$root/requirements/lock-cuda.txt")
  rm -rf "$dir" && mkdir -p "$dir/wheel"
  "${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 -d "$dir/wheel" "torchao==$version"
  "${PYTHON:-python3}" -m zipfile -e "$dir"/wheel/torchao-*.whl "$dir/site"
  rm -rf "$dir/wheel" "$dir/site/test"
  echo "device_check: torchao $version unpacked into $dir/site (carry $dir with the checkout)"
  exit 0
fi
site="$root/build/device-site/site"
[ -d "$site" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$root/scripts/device_check.py" "$@"
